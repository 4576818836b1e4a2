"""The network of examples/custom_model.py, in a module of its own so that eval, predict and
export can import it again (`PYTHONPATH=examples`)."""

from __future__ import annotations

import torch
from torch import nn


class SmallNet(nn.Module):
    """A convolution, GroupNorm (no batch statistics: the same on one process or two), a head."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))
