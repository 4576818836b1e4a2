"""A program that trains one network at several learning rates, one `accel_train.fit` after
another in the same processes (a sweep); run under a real launcher by test_sweep_in_one_program.py:

    torchrun --nproc-per-node 2 -m tests.fit_sweep_probe WORK_DIR 0.1,0.01

Each run goes to WORK_DIR/run-LR, from the same initial weights and data, so a run made second
in a sweep can be compared with the same run made alone in a new program."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torchvision.datasets import FakeData

import accel_train


def main() -> int:
    work, learning_rates = Path(sys.argv[1]), [float(lr) for lr in sys.argv[2].split(",")]
    images = {split: FakeData(size, (3, 16, 16), num_classes=2, random_offset=offset)
              for split, size, offset in (("train", 64, 0), ("eval", 32, 1000))}
    for learning_rate in learning_rates:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(8, 2))
        accel_train.fit(model, images["train"], images["eval"], batch_size=8, epochs=1,
                        accumulation_steps=2, learning_rate=learning_rate,
                        mixed_precision="no", channels_last=False, plots=False,
                        progress="log", output_dir=str(work / f"run-{learning_rate}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
