"""A user's network with a bug that only one rank's data meets (importable with
PYTHONPATH=tests, as `--model failing_nets:fails_on_rank_1`)."""

from __future__ import annotations

import os

from torch import nn

FAILING_CALL = 3  # the training forward pass of rank 1 that raises


class FailsOnRank1(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.training_calls = 0

    def forward(self, images):
        if self.training:
            self.training_calls += 1
            if os.environ.get("RANK") == "1" and self.training_calls == FAILING_CALL:
                raise ZeroDivisionError("a bug only rank 1's batch meets")
        return self.body(images)


def fails_on_rank_1(num_classes: int = 10) -> FailsOnRank1:
    return FailsOnRank1(num_classes)
