"""Networks of a fixed input size (timm's ViT and kin) trained at another --image-size: built
through timm's own img_size argument, recorded, and rebuilt the same by eval, predict, export
and timm itself.  Oracles: plain timm (create_model with img_size, the position embeddings
resampled by timm.layers.resample_abs_pos_embed, timm's reader of the exported folder)."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed

import accel_train  # noqa: F401  (what a user's program imports first: the small networks too)
from accel_train.model.input_size import create_at_size
from conftest import PINNED, accel_train_here

TINY = ("--dataset", "synthetic", "--synthetic-train-size", "64", "--max-eval-samples", "64",
        "--batch-size", "16",
        "--epochs", "1", "--progress", "log", "--no-plots", *PINNED)


def state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    first, second = a.state_dict(), b.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k])
                                                 for k in first)


@pytest.mark.slow
def test_a_fixed_size_network_is_built_for_the_size_as_timm_builds_it():
    """vit_tiny at 64 px: refused as built (224's position embeddings), so built again with
    img_size=64 from the same random state: the weights timm draws for that size."""
    torch.manual_seed(3)
    model, model_args = create_at_size("vit_tiny_patch16_224", 10, 64)
    torch.manual_seed(3)
    expected = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64)
    assert model_args == {"img_size": 64}
    assert model.pos_embed.shape == (1, 1 + 4 * 4, 192)
    assert state_equal(model, expected)
    assert model.eval()(torch.zeros(2, 3, 64, 64)).shape == (2, 10)


@pytest.mark.parametrize("name", ["test_byobnet", "test_resnet"])
def test_a_network_that_takes_the_size_as_built_is_left_as_it_is(name):
    """test_byobnet's class takes img_size but its forward takes 64 px anyway; test_resnet's
    takes none: both built once, as before (older runs rebuild unchanged)."""
    torch.manual_seed(4)
    model, model_args = create_at_size(name, 10, 64)
    torch.manual_seed(4)
    assert model_args == {}
    assert state_equal(model, timm.create_model(name, num_classes=10))


def test_pretrained_weights_of_the_network_size_are_resampled_to_the_run_size(tmp_path):
    """--pretrained FILE saved at 224 px, trained at 64: timm's loader resamples the position
    embeddings to the 4 x 4 grid (timm.layers' own function the oracle), the rest as saved."""
    source = timm.create_model("vit_tiny_patch16_224", num_classes=10)
    weights = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(weights, str(tmp_path / "vit.safetensors"))
    model, model_args = create_at_size("vit_tiny_patch16_224", 10, 64,
                                       pretrained=str(tmp_path / "vit.safetensors"))
    assert model_args == {"img_size": 64}
    expected = resample_abs_pos_embed(weights["pos_embed"], new_size=(4, 4),
                                      num_prefix_tokens=1)
    assert torch.allclose(model.pos_embed, expected)
    assert torch.equal(model.blocks[0].attn.qkv.weight, weights["blocks.0.attn.qkv.weight"])


@pytest.mark.slow
def test_a_vit_trains_at_64_px_and_eval_export_and_timm_rebuild_it(tmp_path):
    """The whole way: trained at --image-size 64, evaluated by eval, its checkpoint exported,
    and the export opened by timm itself (local-dir:): the run's weights, a forward at 64 px."""
    run = tmp_path / "run"
    accel_train_here("--model", "vit_tiny_patch16_224", "--image-size", "64", *TINY,
                     "--output-dir", str(run), check=True)
    checkpoint_specs = list((run / "checkpoints").rglob("model_config.json"))
    assert checkpoint_specs and all(json.loads(path.read_text())["model_args"] ==
                                    {"img_size": 64} for path in checkpoint_specs)
    config = json.loads((run / "config.json").read_text())
    assert config["model_args"]["img_size"] in (64, [64, 64])
    assert accel_train_here("eval", str(run)).returncode == 0
    assert accel_train_here("eval", str(run / "checkpoints")).returncode == 0
    export = tmp_path / "export"  # from the checkpoint: built again from its model_config.json
    assert accel_train_here("export", str(run / "checkpoints"), "--output-dir",
                            str(export)).returncode == 0
    rebuilt = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    saved = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in saved.items())
    assert rebuilt(torch.zeros(1, 3, 64, 64)).shape == (1, config["num_classes"])


def test_a_size_the_network_cannot_take_even_so_is_one_line(tmp_path):
    """test_maxvit at 100 px: built for it or not, its windows do not divide the grid, and the
    run says so in one line that names the size it was built for."""
    result = accel_train_here("--model", "test_maxvit", "--image-size", "100", *TINY,
                              "--output-dir", str(tmp_path / "run"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--image-size 100 does not work with test_maxvit" in lines[0]
    assert "must be divisible by window" in lines[0] and "try --image-size 160" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_size_its_patches_do_not_divide_is_one_line(tmp_path):
    """vit_tiny (16-pixel patches) at 100 px builds and runs, and would train on the top-left
    96x96 pixels only: that the last 4 rows and columns change nothing is checked in plain
    timm here, and the run refuses the size in one line naming the two that fit."""
    model = timm.create_model("vit_tiny_patch16_224", img_size=100, num_classes=3).eval()
    images = torch.rand(2, 3, 100, 100)
    edges = images.clone()
    edges[:, :, 96:, :] = 0
    edges[:, :, :, 96:] = 0
    with torch.no_grad():
        assert torch.equal(model(images), model(edges))  # what the refusal spares a user
    result = accel_train_here("--model", "vit_tiny_patch16_224", "--image-size", "100", *TINY,
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "accel_train: error: --image-size 100 is not a whole number of vit_tiny_patch16_224's "
        "16-pixel patches: it would never see the last 4 rows and columns of each image; use "
        "--image-size 96 or 112"], result.stderr
    assert not (tmp_path / "run").exists()
    # padded patches (timm's dynamic_img_pad) see every pixel: nothing to refuse
    from accel_train.model.input_size import check_whole_patches
    check_whole_patches(timm.create_model("vit_tiny_patch16_224", img_size=100,
                                          dynamic_img_pad=True), "padded", 100)
    check_whole_patches(model, "at 96", 96)


class _OwnPatches(torch.nn.Module):
    """A network of one's own with a patch embedding of its own: a strided convolution whose
    patch_size is a plain int, and no timm attribute such as dynamic_img_pad."""

    def __init__(self):
        super().__init__()
        self.patch_embed = torch.nn.Conv2d(3, 8, kernel_size=16, stride=16)
        self.patch_embed.patch_size = 16
        self.head = torch.nn.Linear(8, 3)

    def forward(self, images):
        return self.head(self.patch_embed(images).mean(dim=(2, 3)))


def test_a_patch_embedding_of_ones_own_is_checked_as_timms():
    from accel_train.base.errors import UsageError
    from accel_train.model.input_size import check_whole_patches
    with pytest.raises(UsageError, match="--image-size 100 is not a whole number of own's "
                                         "16-pixel patches: .* use --image-size 96 or 112"):
        check_whole_patches(_OwnPatches(), "own", 100)
    check_whole_patches(_OwnPatches(), "own", 112)


@pytest.mark.slow
def test_model_args_edited_into_another_shape_are_one_line(tmp_path):
    """A run folder's config.json whose model_args is no longer a mapping: eval says so in one
    line (timm's reader would pass it on to create_model)."""
    run = tmp_path / "run"
    accel_train_here("--model", "vit_tiny_patch16_224", "--image-size", "64", *TINY,
                     "--max-steps", "1", "--output-dir", str(run), check=True)
    config = json.loads((run / "config.json").read_text())
    config["model_args"] = ["img_size", 64]
    (run / "config.json").write_text(json.dumps(config))
    result = accel_train_here("eval", str(run))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "config.json is not a timm model config" in result.stderr


@pytest.mark.slow
def test_the_network_built_for_the_size_keeps_the_runs_dropout_and_drop_path():
    """--drop-rate and --drop-path reach the network built again for the size (the oracle:
    timm's own network with them and img_size)."""
    torch.manual_seed(5)
    model, _ = create_at_size("vit_tiny_patch16_224", 10, 64, drop_rate=0.3, drop_path=0.1)
    torch.manual_seed(5)
    expected = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64,
                                 drop_rate=0.3, drop_path_rate=0.1)
    assert state_equal(model, expected)
    assert model.head_drop.p == expected.head_drop.p == 0.3
    assert model.blocks[-1].drop_path1.drop_prob == expected.blocks[-1].drop_path1.drop_prob
    assert model.blocks[-1].drop_path1.drop_prob > 0
