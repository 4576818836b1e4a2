"""Users' networks that fail (importable with PYTHONPATH=tests, as
`--model failing_nets:fails_on_rank_1`): one with a bug only one rank's data meets, one whose
forward pass gives NaN as an fp16 overflow does while its weights stay finite."""

from __future__ import annotations

import os

import torch
from torch import nn

FAILING_CALL = 3  # the training forward pass of rank 1 that raises


class FailsOnRank1(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.training_calls = 0

    def forward(self, images):
        if self.training and len(images) != 2:
            self.training_calls += 1
            if os.environ.get("RANK") == "1" and self.training_calls == FAILING_CALL:
                raise ZeroDivisionError("a bug only rank 1's batch meets")
        return self.body(images)


def fails_on_rank_1(num_classes: int = 10) -> FailsOnRank1:
    return FailsOnRank1(num_classes)


class _NaNForward(torch.autograd.Function):
    """NaN out, a zero gradient back: what a GradScaler makes of an overflowing forward pass
    (the step is skipped, the weights stay as they were), on a CPU, where no scaler runs."""

    @staticmethod
    def forward(ctx, logits):
        return torch.full_like(logits, float("nan"))

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


NAN_CALLS_ENV = "NAN_TRAINING_CALLS"  # "FIRST-LAST" (1-based, inclusive) or "FIRST-" (on)
NAN_RANK_ENV = "NAN_ON_RANK"  # only this rank's passes give NaN (unset: every rank's)


class NaNWhileTraining(nn.Module):
    """The training forward passes numbered `first` to `last` give NaN logits (evaluation's
    stay finite).  The start's probes of the network (two images each: model/build.py) are
    not counted, so that pass N is batch N of a run whose batches hold more."""

    def __init__(self, num_classes: int, first: int, last: float):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.first, self.last = first, last
        self.training_calls = 0

    def forward(self, images):
        logits = self.body(images)
        if self.training and len(images) != 2:
            self.training_calls += 1
            if self.first <= self.training_calls <= self.last:
                return _NaNForward.apply(logits)
        return logits


def nan_while_training(num_classes: int = 10) -> NaNWhileTraining:
    first, _, last = os.environ.get(NAN_CALLS_ENV, "1-").partition("-")
    rank = os.environ.get(NAN_RANK_ENV)
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return NaNWhileTraining(num_classes, 1, 0)  # never
    return NaNWhileTraining(num_classes, int(first), float(last) if last else float("inf"))
