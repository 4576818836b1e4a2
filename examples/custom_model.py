"""Your own network on your own dataset, through the Python API.

    python examples/custom_model.py --output-dir runs/custom                  # one process
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \
        examples/custom_model.py --output-dir runs/custom2 --batch-size 16    # two processes

Every process runs this script; `accel_train.fit` joins them into one run. With two processes
and half the batch each, the global batch is the same, and so are the trained weights (within
float rounding): tests/test_api.py checks that.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

import accel_train


class Stripes(Dataset):
    """Images of horizontal, vertical or diagonal stripes, with some noise: float CHW in [0, 1].
    Generated from the index alone, so every process sees the same data."""

    classes = ["horizontal", "vertical", "diagonal"]

    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset
        self.targets = [(offset + i) % 3 for i in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        label = self.targets[index]
        generator = torch.Generator().manual_seed(self.offset + index)
        y, x = torch.meshgrid(torch.arange(24.0), torch.arange(24.0), indexing="ij")
        phase = (y, x, x + y)[label] + float(torch.rand(1, generator=generator)) * 6
        stripes = (torch.sin(phase * 0.8) + 1) / 2
        noise = torch.rand(3, 24, 24, generator=generator) * 0.3
        return (stripes.expand(3, -1, -1) * 0.7 + noise).clamp(0, 1), label


class SmallNet(nn.Module):
    """A convolution, GroupNorm (no batch statistics: the same on one process or two), a head."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/custom")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)  # the network's initial weights: the same in every process
    run_dir = accel_train.fit(
        SmallNet(), Stripes(256), Stripes(64, offset=10_000),
        batch_size=args.batch_size, epochs=args.epochs, output_dir=args.output_dir,
        learning_rate=0.05, augment=False, mixed_precision="no", channels_last=False,
        progress="log", plots=False)
    print(f"trained: {run_dir}")


if __name__ == "__main__":
    main()
