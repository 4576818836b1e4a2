"""--reprob's erasing for batches drawn on the device: its plans drawn ahead by loader workers.

A micro-batch's erasing plan (augment.erasing_plan: timm's RandomErasing, each image seeded by
its (seed, epoch, index)) is host work, about 14 ms for 512 CIFAR-10 images on one core of a
2-core AMD EPYC, where a GPU's step of the CIFAR ResNet-9 takes about 6 ms (NVIDIA H200): drawn
by the training process, the epoch's plans stalled its start and set the pace (0.37x the
DataLoader's steps a second with erasing, BENCHMARKS.md).  Here the run's loader workers draw
them, one micro-batch each at a time, ahead of the loop as a DataLoader's images are; a plan is
a function of (seed, epoch, index) alone, so whichever worker draws it the batch is the same,
and so is a resumed run's.  With no workers (--num-workers 0) the training process draws each
plan as its batch comes, not the whole epoch's at its start.  Held photographs' crops, flips
and jitter come the same way, before their erasing plans (held_photos.PhotoPlans).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from accel_train.data.loaders import EpochSampler, end_workers
from accel_train.data.transforms import ImageTransform
from accel_train.data.worker_deaths import watch_workers_quietly


class MicroBatchPositions(Sampler):
    """(epoch, k) for a rank's micro-batches k of one pass: `start` sets the pass before each
    iteration (the training process reads the sampler; workers only see the positions)."""

    def __init__(self):
        self.epoch, self.first, self.end = 0, 0, 0

    def start(self, epoch: int, first: int, end: int) -> None:
        self.epoch, self.first, self.end = epoch, first, end

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, k) for k in range(self.first, self.end)])

    def __len__(self) -> int:
        return self.end - self.first


class ErasingPlans(Dataset):
    """Item (epoch, k): the erasing plan of rank `rank`'s k-th micro-batch of that epoch
    (EpochSampler.rank_batches), for images of `shape` (a micro-batch of placed pixels)."""

    def __init__(self, transform: ImageTransform, sampler: EpochSampler, shape: torch.Size,
                 seed: int, num_processes: int, rank: int):
        self.transform, self.sampler, self.shape, self.seed = transform, sampler, shape, seed
        self.num_processes, self.rank = num_processes, rank
        self._order: tuple[Optional[int], Optional[np.ndarray]] = (None, None)

    def batch_indices(self, epoch: int) -> np.ndarray:
        """This rank's micro-batches of `epoch` as sample indices [count, B] (the epoch's order
        is made once per epoch in each process that asks)."""
        if self._order[0] != epoch:
            self._order = (epoch, self.sampler.rank_batches(epoch, self.num_processes,
                                                            self.shape[0], self.rank).numpy())
        return self._order[1]

    def __getitem__(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, k = position
        indices = self.batch_indices(epoch)[k]
        return self.transform.erasing_plan(self.shape, self.seed,
                                           np.full(len(indices), epoch, dtype=np.int64), indices)


# (plans, positions) -> the DataLoader that draws them: the run's loader settings
PlanLoaderMaker = Callable[[Dataset, Sampler], DataLoader]


class PlansAhead:
    """The plans of a device-drawn pass (a tuple of host tensors a micro-batch: `plans`'
    items), in micro-batch order, from `make_loader`'s DataLoader (with no workers, the
    training process draws each as its batch comes)."""

    def __init__(self, plans: Dataset, make_loader: PlanLoaderMaker):
        self.positions = MicroBatchPositions()
        self.loader = make_loader(plans, self.positions)

    def end_workers(self) -> None:
        """The workers it keeps between passes ended now (after one of them died, and at the
        run's end); the next pass starts new ones."""
        end_workers(self.loader)

    def each(self, epoch: int, first: int, end: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """The plans of micro-batches `first` to `end` - 1 of `epoch` (erasing's: flat
        positions, values)."""
        self.positions.start(epoch, first, end)
        yield from watch_workers_quietly(self.loader)
