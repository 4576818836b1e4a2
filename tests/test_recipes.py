"""Every recipe in recipes/ loads through --config and starts training (one optimizer step on the
embedded data), and the run records the recipe's settings."""

from __future__ import annotations

import pytest
import yaml

from conftest import PINNED, accel_train_here, REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# Keep each start to seconds: tiny data, one step; the model and every recipe setting but the
# sizes stay the recipe's (a recipe without a model gets the small test model).
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--max-eval-samples", "8",
        "--batch-size", "4", "--max-steps", "1", "--epochs", "1", "--progress", "log",
        "--no-plots", "--num-workers", "0", *PINNED]  # (auto's probe: tests/test_autotune.py)


def test_there_are_recipes():
    assert {r.name for r in RECIPES} >= {"cifar10-cpu-10min.yaml", "finetune-layer-decay.yaml",
                                         "imagenet-deit-small-gpus.yaml"}


# A ViT's start takes seconds more than the others': in the full suite only
@pytest.mark.parametrize("recipe", [
    pytest.param(recipe, marks=pytest.mark.slow) if "deit" in recipe.stem else recipe
    for recipe in RECIPES], ids=lambda path: path.stem)
def test_a_recipe_loads_and_starts(recipe, tmp_path):
    settings = yaml.safe_load(recipe.read_text())
    assert recipe.read_text().startswith("#") and "Source:" in recipe.read_text()
    extra = [] if "model" in settings else ["--model", "test_resnet"]
    out = tmp_path / "run"
    accel_train_here("--config", str(recipe), *TINY, *extra, "--output-dir", str(out),
                     check=True)
    recorded = yaml.safe_load((out / "config.yaml").read_text())["train"]
    # (the network --smaller-models chose is recorded as `model`, with no more to choose from:
    # tests/test_network_choice.py)
    overridden = {"batch_size", "epochs", "mixed_precision", "channels_last", "smaller_models",
                  "time_budget"}
    for key, value in settings.items():
        if key not in overridden:
            assert recorded[key] == value, key
    assert recorded["time_budget"] is None  # --epochs typed replaces a recipe's budget
    assert (out / "model.safetensors").is_file()
