"""Your own network on your own dataset, through the Python API.

    python examples/custom_model.py --output-dir runs/custom                  # one process
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \
        examples/custom_model.py --output-dir runs/custom2 --batch-size 16    # two processes

Every process runs this script; `accel_train.fit` joins them into one run. With two processes
and half the batch each, the global batch is the same, and so are the trained weights (within
float rounding): tests/test_api.py checks that.

The network lives in its own module, custom_net.py, and not in this script: the run records it
as `custom_net:SmallNet`, and `predict` and `export` rebuild it by importing that module, which
they could not do from a script's own classes:

    PYTHONPATH=examples accel-train predict runs/custom IMAGES...
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset

import accel_train
from custom_net import SmallNet  # (this script's folder is on sys.path)


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
    if os.environ.get("RANK", "0") == "0":  # every process gets the folder back; one says it
        print(f"trained: {run_dir}")


if __name__ == "__main__":
    main()
