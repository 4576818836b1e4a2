"""--pretrained FILE of a model one trained: its classifier kept for the same classes (rows put
in the new data's class order), a new one otherwise, and the normalization its weights learned
under.  Oracles: eval of the original run on the same images (eval matches labels to the model
by class name: test_eval_oracle.py checks it against plain torch), safetensors' own reader for
the tensors, the file's folder's config.json read with json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from accel_train.data import synthetic
from conftest import TINY_TRAIN, accel_train_here, model_spec_of

# a start that changes no weight: the backbone frozen (its BatchNorm in eval mode), the
# classifier's steps 1e-30 of its values (below float32's resolution)
NO_CHANGE = ["--freeze-backbone", "--learning-rate", "1e-30", "--batch-size", "8", "--epochs",
             "1", "--model", "test_resnet", "--progress", "log", "--no-plots",
             "--mixed-precision", "no", "--no-channels-last"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrained_file") / "run"
    accel_train_here(*TINY_TRAIN, "--max-steps", "12", "--lr", "0.2", "--output-dir", str(out),
                     check=True)
    return out


def _class_folder(root: Path, classes: list[str], per_class: int = 4) -> Path:
    """PNGs of the synthetic shapes in class folders (sorted by name: another order than the
    synthetic set's), each named class renamed from the shape class at its position."""
    images, labels = synthetic.splits(256)["test"]
    shapes = synthetic.CLASS_NAMES
    for position, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        chosen = [i for i in range(len(labels)) if shapes[labels[i]] == shapes[position]]
        for i in chosen[:per_class]:
            Image.fromarray(images[i]).save(folder / f"{i:04d}.png")
    return root


def _eval(run: Path, folder: Path) -> dict:
    result = accel_train_here("eval", str(run), "--data-dir", str(folder), "--split", "all",
                              "--mixed-precision", "no", "--json", check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _start(file: Path, folder: Path, out: Path, *extra: str):
    return accel_train_here("--data-dir", str(folder), "--pretrained", str(file),
                            "--output-dir", str(out), *NO_CHANGE, *extra, check=True)


def test_the_same_classes_in_another_order_keep_the_trained_classifier(trained, tmp_path):
    folder = _class_folder(tmp_path / "photos", list(synthetic.CLASS_NAMES))
    assert sorted(synthetic.CLASS_NAMES) != list(synthetic.CLASS_NAMES)  # another order
    result = _start(trained / "model.safetensors", folder, tmp_path / "again")
    assert (f"  weights: {trained / 'model.safetensors'}, its classifier too, its rows put in "
            f"the data's class order (the same 10 classes); normalized as it was trained (its "
            f"folder's mean and std)\n") in result.stdout
    before, after = _eval(trained, folder), _eval(tmp_path / "again", folder)
    assert after["count"] == before["count"] == 40
    assert after["loss"] == pytest.approx(before["loss"], abs=1e-5)
    assert after["per_class"] == before["per_class"]
    # the file's normalization, not timm's for the architecture (0.5 for test_resnet)
    spec, original = model_spec_of(tmp_path / "again"), model_spec_of(trained)
    assert (spec["mean"], spec["std"]) == (original["mean"], original["std"]) != \
        ([0.5] * 3, [0.5] * 3)
    # a checkpoint's weights, named by its model_config.json, keep it too
    checkpoint = sorted((trained / "checkpoints").iterdir())[-1]
    result = _start(checkpoint / "model.safetensors", folder, tmp_path / "from_checkpoint")
    assert "its classifier too, its rows put in the data's class order" in result.stdout


def test_other_classes_or_counts_start_a_new_classifier(trained, tmp_path):
    tensors = load_file(str(trained / "model.safetensors"))
    renamed = _class_folder(tmp_path / "renamed", [f"kind{k}" for k in range(10)], 2)
    result = _start(trained / "model.safetensors", renamed, tmp_path / "renamed_run")
    assert (f"  weights: {trained / 'model.safetensors'} with a new 10-class classifier (the "
            f"file's is for other classes: disk, square, diamond, ring, plus and 5 more); "
            f"normalized as it was trained") in result.stdout
    started = load_file(str(tmp_path / "renamed_run" / "model.safetensors"))
    assert not torch.allclose(started["fc.weight"], tensors["fc.weight"])
    assert torch.equal(started["conv1.0.weight"], tensors["conv1.0.weight"])  # the backbone's

    three = _class_folder(tmp_path / "three", list(synthetic.CLASS_NAMES[:3]), 6)
    result = _start(trained / "model.safetensors", three, tmp_path / "three_run")
    assert (f"  weights: {trained / 'model.safetensors'} with a new 3-class classifier (the "
            f"file's has 10 classes)") in result.stdout
    assert load_file(str(tmp_path / "three_run" / "model.safetensors"))["fc.weight"].shape == \
        (3, tensors["fc.weight"].shape[1])


def test_a_file_alone_keeps_a_classifier_of_the_datas_size(trained, tmp_path):
    """No config.json beside it: as many classes is all there is to go by; the classifier's
    tensors are the file's, in its own order, and the normalization is not the file's."""
    alone = tmp_path / "weights" / "mine.safetensors"
    alone.parent.mkdir()
    shutil.copy(trained / "model.safetensors", alone)
    folder = _class_folder(tmp_path / "photos", list(synthetic.CLASS_NAMES), 2)
    result = _start(alone, folder, tmp_path / "run")
    assert (f"  weights: {alone}, its 10-class classifier too (as many classes as the data; no "
            f"class names beside the file to compare)\n") in result.stdout
    started = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert torch.equal(started["fc.weight"], load_file(str(alone))["fc.weight"])


def test_what_the_folder_says_of_a_file(tmp_path):
    from accel_train.model.pretrained_file import described_beside
    file = tmp_path / "model.safetensors"
    assert described_beside(file).class_names is None
    (tmp_path / "config.json").write_text("{damaged")
    assert described_beside(file).mean is None  # unreadable: nothing said (the load names it)
    (tmp_path / "config.json").write_text(json.dumps({
        "architecture": "resnet18", "label_names": ["a", "b"],
        "pretrained_cfg": {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}}))
    said = described_beside(file)
    assert (said.class_names, said.mean, said.std) == (["a", "b"], (0.1, 0.2, 0.3),
                                                      (0.4, 0.5, 0.6))
    (tmp_path / "config.json").write_text(json.dumps({
        "architecture": "resnet18", "pretrained_cfg": {"mean": [0.1, 0.2], "std": [1, 1, 1]}}))
    said = described_beside(file)
    assert (said.class_names, said.mean, said.std) == (None, None, None)
    for mean in (["a", "b", "c"], [True, 0.5, 0.5]):  # not numbers: nothing taken
        (tmp_path / "config.json").write_text(json.dumps({
            "architecture": "resnet18", "pretrained_cfg": {"mean": mean, "std": [1, 1, 1]}}))
        assert described_beside(file).mean is None
