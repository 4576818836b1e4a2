"""A program that trains one network at several learning rates, one `accel_train.fit` after
another in the same processes (a sweep); run under a real launcher by test_sweep_in_one_program.py:

    torchrun --nproc-per-node 2 -m tests.fit_sweep_probe WORK_DIR 0.1,0.01
    python -m tests.fit_sweep_probe WORK_DIR 0.1/bf16,0.01

A run is LR or LR/PRECISION (`mixed_precision`, "auto" when not given).  Each run goes to
WORK_DIR/run-LR, from the same initial weights and data, so a run made second in a sweep can be
compared with the same run made alone in a new program.  The network is wide enough at 32 px
for bf16 to run it about three times as fast as fp32 where the CPU has native bf16 (timed on a
2-core Intel Xeon with AMX), so that "auto" has a choice to make there."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torchvision.datasets import FakeData

import accel_train


def main() -> int:
    work, runs = Path(sys.argv[1]), [f"{run}/auto".split("/")[:2] for run in sys.argv[2].split(",")]
    images = {split: FakeData(size, (3, 32, 32), num_classes=2, random_offset=offset)
              for split, size, offset in (("train", 64, 0), ("eval", 32, 1000))}
    for learning_rate, precision in runs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
                              nn.Conv2d(32, 32, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(32, 2))
        accel_train.fit(model, images["train"], images["eval"], batch_size=8, epochs=1,
                        accumulation_steps=2, learning_rate=float(learning_rate),
                        mixed_precision=precision, channels_last=False, plots=False,
                        progress="log", output_dir=str(work / f"run-{learning_rate}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
