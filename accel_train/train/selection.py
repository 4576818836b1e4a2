"""Which held-out number picks the run's best (`--eval-metric`, timm's train.py name): the
checkpoints --keep-best keeps, the better of the raw and EMA weights saved as model.safetensors,
and the best the run reports.

top-1 by default.  mean_class_top1 (balanced accuracy) is the one to pick by when the classes
are far from equal in number: top-1 then rewards a model that never names the rare class.
loss is the one number here where lower is better.
"""

from __future__ import annotations

import math
from typing import Optional

from accel_train.base.errors import RunDiffers

WORDS = {"top1": "top-1", "top5": "top-5", "loss": "loss",
         "mean_class_top1": "mean per-class top-1"}
LOWER_IS_BETTER = frozenset({"loss"})


def rank(metric: str, value: Optional[float]) -> float:
    """`value` of `metric` as a number where larger is better (None: below every value)."""
    if value is None:
        return -math.inf
    return -value if metric in LOWER_IS_BETTER else value


def best_of(metric: str, *values: Optional[float]) -> Optional[float]:
    """The best of `values` by `metric` (None where all are None)."""
    given = [value for value in values if value is not None]
    return max(given, key=lambda value: rank(metric, value)) if given else None


def value_text(metric: str, value: float) -> str:
    """'93.10%', or a loss's '0.2345'."""
    return f"{value:.4f}" if metric == "loss" else f"{value:.2%}"


def describe(metric: str, value: float) -> str:
    """'top-1 93.10%', 'loss 0.2345', 'mean per-class top-1 88.00%'."""
    return f"{WORDS[metric]} {value_text(metric, value)}"


def top5_picks_nothing(metric: str, num_classes: int) -> Optional[str]:
    """A warning where --eval-metric top5 cannot tell evaluations apart: with 5 classes or
    fewer every class is among an image's top 5 (the evaluation's top-k is of min(5, classes)),
    every evaluation scores 100%, and the first one stays the best."""
    if metric != "top5" or num_classes > 5:
        return None
    return (f"--eval-metric top5 with {num_classes} classes: every class is among an image's "
            f"top 5, so every evaluation scores 100% and picks nothing (the best checkpoints, "
            f"the weights saved); pick by top1, loss or mean_class_top1")


def check_same_eval_metric(before: Optional[str], now: str) -> None:
    """The checkpoints a run kept as its best, and the best it reports, were picked by one
    metric: ranked by another on resume, the earlier ones would be compared by a number they
    were never chosen by."""
    before = before or "top1"  # before --eval-metric, every run picked by top-1
    if before != now:
        raise RunDiffers(f"the checkpoint's run picked its best checkpoints and weights by "
                         f"--eval-metric {before}, this start by {now}; resume with "
                         f"--eval-metric {before}, or start a new run")
