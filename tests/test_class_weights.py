"""--class-weight balanced: the weights counted by hand, the soft-target loss of Mixup/CutMix
written out in plain torch (and equal to timm's own loss where every weight is 1), the
refusals in one line.  The hard-label loss and its step through the command line:
test_flags.py::test_class_weight_balanced_weighs_the_first_loss_and_step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.class_weights import balanced_weights, describe_weights
from accel_train.data.mixing import maybe_mixup
import numpy as np
import yaml

from accel_train.data import synthetic
from conftest import TINY_TRAIN, accel_train_here


def test_balanced_weights_by_hand():
    # 45 cats and 5 dogs: 50 / (2 x 45) and 50 / (2 x 5)
    labels = torch.tensor([0] * 45 + [1] * 5)
    assert balanced_weights(labels, ["cat", "dog"]).tolist() == pytest.approx([50 / 90, 5.0])
    # 6, 3 and 1 of three classes: 10 / 18, 10 / 9, 10 / 3
    labels = torch.tensor([2] * 6 + [0] * 3 + [1])
    weights = balanced_weights(labels, ["a", "b", "c"])
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([10 / 9, 10 / 3, 10 / 18])
    # every class weighs alike: the weights times the counts are equal
    assert (weights * torch.tensor([3, 1, 6])).tolist() == pytest.approx([10 / 3] * 3)
    assert describe_weights(weights, ["a", "b", "c"]) == (
        "each class's loss weighted by its rarity, x0.556 (c) to x3.33 (b) "
        "(--class-weight balanced)")


def test_a_class_without_training_images_is_refused_by_name():
    with pytest.raises(UsageError) as refused:
        balanced_weights(torch.tensor([0, 0, 2]), ["cat", "dog", "owl"])
    assert str(refused.value) == (
        "--class-weight balanced: class(es) dog have no training images to weigh by; give them "
        "images (or a larger --max-train-samples), or drop the flag")
    with pytest.raises(UsageError, match=r"class\(es\) owl have no training images"):
        balanced_weights(torch.tensor([0, 1, 0]), ["cat", "dog", "owl"])  # the last class
    names = [f"c{i}" for i in range(9)]
    with pytest.raises(UsageError, match=r"class\(es\) c1, c2, c3, c4, c5 and 2 more have"):
        balanced_weights(torch.tensor([0, 0, 8]), names)  # 7 without images: 5 named
    with pytest.raises(UsageError, match=r"class\(es\) c1, c2, c3, c4, c5 have no"):
        balanced_weights(torch.tensor([0, 6, 7, 8]), names)  # exactly 5: all named
    with pytest.raises(UsageError, match=r"class\(es\) c1, c2, c3, c4, c5 and 1 more have"):
        balanced_weights(torch.tensor([0, 7, 8]), names)  # 6: the sixth counted


def test_the_mixed_batches_loss_weighs_each_class_term():
    """Soft targets (Mixup, CutMix): the batch's mean of sum_c -w_c y_c log p_c, written out
    here; with every weight 1, timm's SoftTargetCrossEntropy."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3)
    targets = torch.softmax(torch.randn(6, 3), dim=1)
    weights = torch.tensor([0.5, 2.0, 1.25])
    config = TrainConfig(mixup=0.8, label_smoothing=0.1)
    loss = maybe_mixup(config, 3, weights).loss_fn(logits, targets)
    by_hand = (-(weights * targets * F.log_softmax(logits, dim=1)).sum(dim=1)).mean()
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-6)
    ones = maybe_mixup(config, 3, torch.ones(3)).loss_fn(logits, targets)
    assert float(ones) == pytest.approx(float(SoftTargetCrossEntropy()(logits, targets)),
                                        rel=1e-6)
    assert float(loss) != pytest.approx(float(ones), rel=1e-3)


def test_streamed_shards_are_refused_before_anything_is_written(synthetic_shards, tmp_path):
    out = tmp_path / "run"
    result = accel_train_here("--data-dir", str(synthetic_shards), "--model", "test_resnet",
                              "--epochs", "1", "--class-weight", "balanced",
                              "--output-dir", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "accel_train: error: --class-weight balanced counts each class's training images "
        "before training, which streamed shards do not tell; drop the flag, or train from the "
        "image folder or parquet files"]
    assert not out.exists()


def test_a_run_weighs_by_its_training_splits_counts(tmp_path):
    """Through the command line: the weights config.yaml records and the summary's words are
    those of the training split's class counts, counted here."""
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "64", "--class-weight",
                              "balanced", "--output-dir", str(out), check=True)
    _, labels = synthetic.splits(64)["train"]
    counts = np.bincount(labels, minlength=len(synthetic.CLASS_NAMES))
    weights = [64 / (len(counts) * int(n)) for n in counts]
    recorded = yaml.safe_load((out / "config.yaml").read_text())["resolved"]["class_weights"]
    assert recorded["weights"] == pytest.approx(weights, abs=1e-6)
    low, high = int(np.argmin(weights)), int(np.argmax(weights))
    names = synthetic.CLASS_NAMES
    assert (f"  loss: each class's loss weighted by its rarity, x{weights[low]:.3g} ({names[low]}) "
            f"to x{weights[high]:.3g} ({names[high]}) (--class-weight balanced)\n") in result.stdout
