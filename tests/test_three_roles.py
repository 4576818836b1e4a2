"""Train, validation, test: the validation split decides (best checkpoints, EMA or raw weights,
the time budget's probes), the test split is evaluated once at the end and decides nothing.
Given only train and test, validation is carved from train with the fixed seed; --select-on-test
asks for the old use of the test split for selection."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_TRAIN, accel_train_here, write_cifar10_layout
from faults import metrics
from accel_train.config import TrainConfig
from accel_train.data.sources import load_data


def layout(tmp_path: Path, validation_rows: int = 0) -> Path:
    """train.parquet (64 rows) and test.parquet (32 rows); with `validation_rows`, a
    validation.parquet of that many other rows too."""
    folder = write_cifar10_layout(tmp_path / "data", train_rows=64, test_rows=32)
    if validation_rows:
        other = write_cifar10_layout(tmp_path / "other", train_rows=2,
                                     test_rows=validation_rows)
        shutil.copy(other / "test.parquet", folder / "validation.parquet")
    return folder


def loaded(folder: Path, **options):
    return load_data(TrainConfig(data_dir=str(folder), in_memory="never", **options))


def test_train_and_test_carve_validation_from_train_and_keep_test_for_the_end(tmp_path):
    data = loaded(layout(tmp_path), val_fraction=0.25)
    carved = math.ceil(0.25 * 64)
    assert (len(data.train), len(data.held_out), len(data.test)) == (64 - carved, carved, 32)
    # validation rows come from the training split, none of them trained on
    train_rows, held_out_rows = set(data.train.rows), set(data.held_out.rows)
    assert not train_rows & held_out_rows and train_rows | held_out_rows == set(range(64))
    assert data.test.split == "test" and list(data.test.rows) == list(range(32))
    assert "for validation" in data.description and "test kept for the end" in data.description


def test_the_carve_is_the_same_for_every_seed_and_start(tmp_path):
    folder = layout(tmp_path)
    first = loaded(folder, val_fraction=0.25, seed=1)
    second = loaded(folder, val_fraction=0.25, seed=7)
    assert np.array_equal(first.held_out.rows, second.held_out.rows)


def test_a_validation_split_is_used_as_it_is_and_test_kept(tmp_path):
    data = loaded(layout(tmp_path, validation_rows=24))
    assert (len(data.train), len(data.held_out), len(data.test)) == (64, 24, 32)
    assert data.held_out.split == "held-out"


def test_select_on_test_uses_the_test_split_for_selection_and_says_so(tmp_path):
    data = loaded(layout(tmp_path), select_on_test=True)
    assert (len(data.train), len(data.held_out), data.test) == (64, 32, None)
    assert "test split used for selection" in data.description


def test_only_a_training_split_has_no_test(tmp_path):
    folder = layout(tmp_path)
    (folder / "test.parquet").unlink()
    data = loaded(folder, val_fraction=0.25)
    assert data.test is None and len(data.held_out) == math.ceil(0.25 * 64)


def epoch_records(run: Path) -> list[dict]:
    return [r for r in metrics(run) if r.get("type") == "epoch"]


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if "time" not in k and "second" not in k}


@pytest.mark.slow
def test_the_test_split_decides_nothing(tmp_path):
    """Two runs whose test splits differ (other images, other labels) but whose train and
    validation are the same: every record before the end, every kept checkpoint and the chosen
    weights are the same; only the final test numbers differ.  Reading the test split before
    the end (for a decision, a statistic, a probe) would make them differ."""
    first = layout(tmp_path / "a")
    second = layout(tmp_path / "b")
    # other images and labels: the generator's training rows, not its test rows
    other = write_cifar10_layout(tmp_path / "c", train_rows=32, test_rows=2)
    shutil.copy(other / "train.parquet", second / "test.parquet")
    options = [opt for opt in TINY_TRAIN if opt not in ("--dataset", "synthetic")]
    outputs = []
    for data in (first, second):
        out = tmp_path / f"run-{data.parent.name}"
        result = accel_train_here(*options, "--data-dir", str(data), "--epochs", "3",
                                  "--keep-best", "2", "--model-ema", "--model-ema-decay", "0.5",
                                  "--output-dir", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append((out, result.stdout))
    (a, a_stdout), (b, b_stdout) = outputs
    assert "test" in a_stdout.split("data:", 1)[1].splitlines()[0]  # the summary's data line
    ra, rb = epoch_records(a), epoch_records(b)
    assert [untimed(r) for r in ra] == [untimed(r) for r in rb]
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == \
        sorted(p.name for p in (b / "checkpoints").iterdir())
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    test_a = [r for r in metrics(a) if r.get("type") == "test"]
    test_b = [r for r in metrics(b) if r.get("type") == "test"]
    assert len(test_a) == len(test_b) == 1 and test_a[0]["images"] == 32
    assert test_a[0] != test_b[0]


def test_a_broken_test_image_is_named_as_the_test_splits_and_left_out(tmp_path):
    """A test-split photo that does not decode (decoded per step, so named from the batch's
    mark at the end): bad_images.txt names that file, not the validation photo at the same
    position (whole: the mark looked up in the wrong split names nothing), and the test
    record counts the others."""
    from PIL import Image

    root = tmp_path / "photos"
    for split, count in (("train", 4), ("val", 2), ("test", 2)):
        for label, colour in (("a", (200, 40, 40)), ("b", (40, 40, 200))):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40 + 4 * i, 36), colour).save(root / split / label / f"{i}.jpg")
    cut = root / "test" / "a" / "0.jpg"
    cut.write_bytes(cut.read_bytes()[:200])
    out = tmp_path / "run"
    options = [opt for opt in TINY_TRAIN if opt not in ("--dataset", "synthetic")]
    accel_train_here(*options, "--data-dir", str(root), "--in-memory", "never",
                     "--num-workers", "0", "--image-size", "32", "--batch-size", "4",
                     "--output-dir", str(out), check=True)
    named = [line.split("\t")[0] for line in (out / "bad_images.txt").read_text().splitlines()]
    assert named == [str(Path("test") / "a" / "0.jpg")], named
    (tested,) = [r for r in metrics(out) if r.get("type") == "test"]
    assert tested["images"] == 3, tested
