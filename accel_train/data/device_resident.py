"""Small training data held on the device: batches drawn there by index, no loader at all.

CIFAR-10's decoded pixels are 150 MB, a sliver of a GPU's memory.  Copied there once, a
micro-batch is an `index_select` of the stored uint8 images, then the small-image path's
resize, crop and flip (`ImageTransform.place`) and normalization and erasing (`finish`) on the
device: no copy of images per step (only --reprob's erasing plans, pinned), and nothing in the
loop waits for the device (no `.item()`, `.cpu()` or blocking copy per step).  Loader workers
run only for --reprob, whose erasing plans they draw ahead (device_erasing.py).

Exact resume and equality with the DataLoader path come from drawing nothing new: an epoch's
order is `EpochSampler.order(epoch)` (a function of (seed, epoch)), each sample's key is
`epoch * N + index`, the crop plan and the erasing plan are the very functions `TrainImages`
calls with the same (seed, epoch, index) arguments, and rank r's k-th micro-batch is the
sampler's batch k * processes + r, as Accelerate's batch-sampler sharding hands it out.  The
order and the crop plans are made on the host once per epoch and copied to the device in one
go; the erasing plans (timm's draws per image: milliseconds per batch) come a micro-batch at a
time.
"""

from __future__ import annotations

import sys
from typing import Iterator, Optional

import numpy as np
import torch

from accel_train.base.errors import UsageError
from accel_train.data.device_erasing import ErasingAhead, ErasingPlans, PlanLoaderMaker
from accel_train.data.loaders import Batch, EpochSampler, FinishOnDevice
from accel_train.data.sources import ArraySource, ImageSource
from accel_train.data.transforms import SMALL_IMAGE, ImageTransform

MEMORY_SHARE = 0.1  # auto holds a training set on the device up to this share of its memory


def stored_bytes(source: ArraySource) -> int:
    """What holding a source on the device takes: its pixels and labels."""
    return sum(t.numel() * t.element_size() for t in (source.images, source.labels))


def device_memory() -> int:
    """The current CUDA device's memory in bytes (Accelerate has set the device by now)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _gb(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


def choose(mode: str, source: ImageSource, transform: ImageTransform, cuda: bool,
           streaming: bool, memory: Optional[int] = None, workers: int = 0) -> tuple[bool, str]:
    """(whether the training set is held on the device, why: for the run's summary).  `mode`
    is --data-on-device; `memory` the device's bytes (read from CUDA when None and needed);
    `workers` the run's loader workers (they draw --reprob's erasing plans).  `always` on data
    this path cannot hold is bad input: a UsageError naming what is missing."""
    flag = f"--data-on-device {mode}"
    if mode == "never":
        return False, f"a DataLoader ({flag})"
    unfit = None  # why this data cannot be drawn on the device, whatever the memory
    if streaming:
        unfit = "the training data is streamed from shards"
    elif not isinstance(source, ArraySource):
        unfit = "the training images are decoded per step, not held in memory (--in-memory)"
    elif max(source.images.shape[-2:]) > SMALL_IMAGE:
        unfit = (f"its images are {max(source.images.shape[-2:])} px, above the "
                 f"{SMALL_IMAGE} px of the batched small-image path")
    elif transform.policy is not None:
        unfit = "--auto-augment's policy works on the host, one image at a time"
    elif not transform.can_place(source.images.shape):
        unfit = "its resize (--crop-pct, --crop-mode, --interpolation) is timm's, on the host"
    if unfit and mode == "always":
        raise UsageError(f"{flag}: {unfit}; use --data-on-device auto or never")
    if unfit:
        return False, f"a DataLoader ({flag}: {unfit})"
    size = stored_bytes(source)
    if mode == "always":
        return True, f"drawn on the device, the training set held there ({_gb(size)}; {flag})"
    if not cuda:
        return False, f"a DataLoader ({flag}: not on a CUDA device)"
    if transform.erases and workers == 0:
        # Its plan is timm's draws image by image on the host: without workers to draw them,
        # the training process would, a few times a GPU step's time for each batch.  With
        # workers the device path never asks more of them than a DataLoader would: the same
        # plans, without the pixels' crop, flip and copy.
        return False, (f"a DataLoader ({flag}: --reprob's erasing is drawn image by image on "
                       f"the host, and with --num-workers 0 the training process would draw "
                       f"it)")
    memory = device_memory() if memory is None else memory
    if size > MEMORY_SHARE * memory:
        return False, (f"a DataLoader ({flag}: the training set's {_gb(size)} is over "
                       f"{MEMORY_SHARE:.0%} of the device's {_gb(memory)})")
    return True, (f"drawn on the device, the training set held there ({_gb(size)}, within "
                  f"{MEMORY_SHARE:.0%} of its {_gb(memory)}; {flag})")


class DeviceResidentBatches:
    """The training set on the device and an epoch's micro-batches drawn from it, from the
    loader's position on (`epoch`, `samples_in_epoch`).  loading.py adds the saved position."""

    name = "train_loader"

    def __init__(self, source: ArraySource, transform: ImageTransform, sampler: EpochSampler,
                 batch_size: int, num_processes: int, rank: int, seed: int,
                 plan_loader: PlanLoaderMaker):
        """`plan_loader` makes the DataLoader that draws --reprob's erasing plans (the run's
        loader workers)."""
        self.source, self.transform, self.sampler = source, transform, sampler
        self.batch_size, self.num_processes, self.rank, self.seed = (batch_size, num_processes,
                                                                     rank, seed)
        self.per_micro_step = batch_size * num_processes
        # places: the stored pixels are resized, cropped and flipped here, on the device
        self.finish = FinishOnDevice(transform, places=True)
        self.epoch, self.samples_in_epoch = 0, 0
        self.device = torch.device("cpu")
        self.images, self.labels = source.images, source.labels
        self.replaced = self._no_marks()
        self.warn = lambda text: print(f"warning: {text}", file=sys.stderr)  # the trainer's
        self.erasing = None
        if transform.erases:
            # The shape TrainImages draws for: the placed pixels (the size the model sees).
            shape = torch.Size((batch_size, source.images.shape[1], transform.image_size,
                                transform.image_size))
            self.erasing = ErasingAhead(ErasingPlans(transform, sampler, shape, seed,
                                                     num_processes, rank), plan_loader)

    @property
    def usable(self) -> int:
        return self.sampler.usable

    def __len__(self) -> int:
        return self.usable // self.per_micro_step

    def prepare(self, accelerator) -> None:
        """The one copy of the data to the device: the stored pixels and labels."""
        self.device = accelerator.device
        self.images = self.source.images.to(self.device)
        self.labels = self.source.labels.to(self.device)
        self.replaced = self._no_marks()

    def _no_marks(self) -> torch.Tensor:
        """In-memory sources replaced their broken images while loading: no sample is marked
        (loaders.replaced_marks), so one tensor of -1 serves every batch (nothing writes it)."""
        return torch.full((self.batch_size,), -1, dtype=torch.long, device=self.device)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.samples_in_epoch = epoch, 0

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor made this epoch, copied without making the host wait for the device
        (pinned memory; torch keeps the pinned block until the copy is done)."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.contiguous().pin_memory().to(self.device, non_blocking=True)

    def _epoch_plan(self, first: int):
        """This rank's micro-batches of the epoch from the `first` on, as device tensors:
        (sample indices [count, B], crop plans [count, B, 3] or None)."""
        epoch, count = self.epoch, len(self) - first
        indices = self.sampler.rank_batches(epoch, self.num_processes, self.batch_size,
                                            self.rank)[first:]                # [count, B]
        flat = indices.reshape(-1).numpy()
        epochs = np.full_like(flat, epoch)
        crops = self.transform.crop_plan(self.seed, epochs, flat)            # [count * B, 3]
        if crops is not None:
            crops = self._to_device(crops.view(count, self.batch_size, 3))
        return self._to_device(indices), crops

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the epoch; every operation is queued on the device, none waits for it."""
        first = self.samples_in_epoch // self.per_micro_step
        if first >= len(self):
            return
        indices, crops = self._epoch_plan(first)
        erasing = self.erasing.each(self.epoch, first, len(self)) if self.erasing is not None \
            else None
        offset = self.epoch * len(self.source)
        for k in range(len(indices)):
            chosen = indices[k]
            plans = () if crops is None else (crops[k],)
            if erasing is not None:
                plans += tuple(self._to_device(part) for part in next(erasing))
            pixels = self.images.index_select(0, chosen)
            labels = self.labels.index_select(0, chosen)
            keys = chosen + offset
            # Counted as handed out: a checkpoint after this batch's step includes it.
            self.samples_in_epoch += self.per_micro_step
            yield Batch(self.finish(pixels, plans), labels, keys, self.replaced)
