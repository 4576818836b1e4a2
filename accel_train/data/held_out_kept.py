"""The held-out split's batches kept on the device after the first evaluation (--data-on-device).

Why: evaluation draws nothing (resize, centre crop, normalize: timm's eval transform), so every
evaluation's batches are the first's, pixel for pixel.  Where the training set is held on the
device, a run's loader workers otherwise exist only to decode the held-out photos again at each
evaluation, and photo data sets held there have validation splits as large as their training
splits (Oxford-IIIT Pets 3,669 test photos beside 3,680; Flowers-102 6,149 beside 1,020): an
evaluation decoded by the workers could take longer than the epoch it follows, the GPU waiting.

What is kept is what the prepared loader handed out (Accelerate's shard of this process, its
last batch evened out), batch by batch: uint8 pixels at the model's size, which the evaluator
normalizes on the device at every evaluation, the first included (`ImageTransform.finish`, as
training's batches are), so later evaluations compute the same numbers from the same tensors in
a quarter of float32's bytes.  Accelerate's `gather_for_metrics` drops the samples its
sampler repeated to even out the last batch by asking the loader being iterated where it
stands; a prepared loader over the indices alone (no pixels, no workers) is iterated beside the
kept batches to tell it, with the same length and batch size, so the same shard and remainder.
"""

from __future__ import annotations

import math
import os
from typing import Iterator, Optional

from torch.utils.data import DataLoader

from accel_train.data.device_resident import MEMORY_SHARE, device_memory, gb

PER_SAMPLE_BYTES = 16  # a kept image's label and mark (int64 each)


def kept_bytes(samples: int, image_size: int, batch_size: int, processes: int) -> int:
    """What one process keeps: its shard of `samples` held-out images (whole batches of
    `batch_size`, as Accelerate evens them out) as uint8 [3, size, size], labels and marks."""
    per_process = math.ceil(samples / (batch_size * processes)) * batch_size
    return per_process * (3 * image_size * image_size + PER_SAMPLE_BYTES)


def machine_memory() -> int:
    """The machine's memory in bytes: where a CPU run keeps them."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def keep_held_out(mode: str, train_on_device: bool, size: int, train_bytes: int, cuda: bool,
                  memory: Optional[int] = None) -> tuple[bool, str]:
    """(whether to keep the held-out batches, the summary's words; "" where the training set is
    not held on the device: then neither is this).  Kept where they fit in MEMORY_SHARE of the
    device's memory (a CPU's: the machine's) beside the training set held there (`train_bytes`),
    for `size` bytes a process (`kept_bytes`)."""
    if mode == "never" or not train_on_device:
        return False, ""
    memory = (device_memory() if cuda else machine_memory()) if memory is None else memory
    where = "the device's" if cuda else "the machine's"
    if train_bytes + size > MEMORY_SHARE * memory:
        return False, (f"from the loader at each evaluation ({gb(size)} a process beside the "
                       f"training set's {gb(train_bytes)} is over {MEMORY_SHARE:.0%} of "
                       f"{where} {gb(memory)})")
    return True, (f"kept on the device after the first evaluation ({gb(size)} a process; "
                  f"--data-on-device {mode})")


class KeptHeldOut:
    """A prepared held-out loader's batches: its first whole pass from the loader, its batches
    kept; every later pass the kept ones, while `pacer` (the same data's indices, prepared the
    same way) is iterated beside them for Accelerate's sake (the module's docstring says why).
    `after_first` runs once the first pass is kept (ending the loader's workers)."""

    def __init__(self, loader, pacer, after_first=lambda: None):
        self.loader, self.pacer, self.after_first = loader, pacer, after_first
        self.kept: Optional[list] = None

    def __iter__(self) -> Iterator:
        if self.kept is not None:
            # strict: the pacer ends with the kept batches, or the shards differ
            for batch, _ in zip(self.kept, self.pacer, strict=True):
                yield batch
            return
        kept = []
        for batch in self.loader:
            kept.append(batch)
            yield batch
        self.kept = kept  # (a pass cut short keeps nothing)
        self.after_first()


def pacer_for(loader: DataLoader) -> DataLoader:
    """A loader over `loader`'s sample indices alone, batched as it is (to be prepared)."""
    return DataLoader(range(len(loader.dataset)), batch_size=loader.batch_size)

