"""Mixup and CutMix: timm's `Mixup` on the batch, with its soft targets and soft-target loss.

timm draws its mixing from numpy's global random state, which would make a run depend on
everything else that ever touched it (and on when it stopped and resumed).  Here every
micro-batch draws from a state seeded by (seed, epoch, position in the epoch, rank), so the
mixing is a function of where the batch sits in the run: exact resume stays bit-identical.
Without either, the run's part is `NoMixing`: the batch as it is, the plain cross-entropy.
Either loss weighs each class by `class_weights` where given (--class-weight, class_weights.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

from accel_train.base.randomness import seeded


class SeededMixup:
    def __init__(self, config, num_classes: int, class_weights: Optional[torch.Tensor] = None):
        self.seed = config.seed
        self.mixup = Mixup(mixup_alpha=config.mixup, cutmix_alpha=config.cutmix,
                           prob=config.mixup_prob, switch_prob=config.mixup_switch_prob,
                           mode="batch", label_smoothing=config.label_smoothing,
                           num_classes=num_classes)
        # torch's cross-entropy of soft targets with a weight is sum_c -w_c y_c log p_c, the
        # batch's mean: timm's SoftTargetCrossEntropy with the weights in it (which it lacks)
        self.loss_fn = SoftTargetCrossEntropy() if class_weights is None else \
            lambda logits, targets: F.cross_entropy(logits, targets, weight=class_weights)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 position: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixed images, soft targets) for the micro-batch at `position`."""
        with seeded(self.seed, *position):
            return self.mixup(images, labels)


class NoMixing:
    def __init__(self, config, class_weights: Optional[torch.Tensor] = None):
        # with weights, the mean is over the batch's weights (torch's rule for class indices)
        self.loss_fn = torch.nn.CrossEntropyLoss(weight=class_weights,
                                                 label_smoothing=config.label_smoothing)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 position: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return images, labels


def maybe_mixup(config, num_classes: int, class_weights: Optional[torch.Tensor] = None):
    """SeededMixup with --mixup or --cutmix, else NoMixing; each has the `loss_fn` that fits
    its targets.  --mixup-prob 0 mixes no batch: NoMixing, whose hard-label loss is the one
    the run without them computes (the soft-target loss is equal only up to rounding).
    `class_weights`: one a class, on the device the logits are on."""
    mixes = (config.mixup > 0 or config.cutmix > 0) and config.mixup_prob > 0
    return SeededMixup(config, num_classes, class_weights) if mixes else \
        NoMixing(config, class_weights)
