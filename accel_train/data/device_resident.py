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

import itertools
import sys
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from accel_train.base.errors import UsageError
from accel_train.data.decode_ahead import DecodeAhead, SideStream, taken_over
from accel_train.data.device_decode import best_share, loop_rate
from accel_train.data.device_erasing import ErasingPlans, PlanLoaderMaker, PlansAhead
from accel_train.data.loaders import Batch, EpochSampler, FinishOnDevice
from accel_train.data import held_photos
from accel_train.data.sources import ArraySource, HFSource, ImageSource
from accel_train.data.transforms import SMALL_IMAGE, ImageTransform

MEMORY_SHARE = 0.1  # auto holds a training set on the device up to this share of its memory
# auto reads every photo's header only where its probed images' sizes put the set within this
# many times MEMORY_SHARE (photos differ: a few probed ones may miss the set's mean by half)
SCAN_MARGIN = 2
# auto holds photos only where the device decodes all but this share of the files: the others
# are decoded at the start by the training process, one by one
AUTO_HOST_DECODED = 0.01


def stored_bytes(source: ArraySource) -> int:
    """What holding a source on the device takes: its pixels and labels."""
    return sum(t.numel() * t.element_size() for t in (source.images, source.labels))


def device_memory() -> int:
    """The current CUDA device's memory in bytes (Accelerate has set the device by now)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def gb(count: int) -> str:
    """Bytes in words: GB from a tenth of one, MB from a tenth of one, kB below."""
    if count >= 1e8:
        return f"{count / 1e9:.2f} GB"
    return f"{count / 1e6:.1f} MB" if count >= 1e5 else f"{count / 1e3:.1f} kB"


def small_in_memory(source: ImageSource) -> bool:
    """Images decoded into memory, all of SMALL_IMAGE px or less: the small-image path's."""
    return isinstance(source, ArraySource) and max(source.images.shape[-2:]) <= SMALL_IMAGE


def _unfit(source: ImageSource, transform: ImageTransform, streaming: bool) -> Optional[str]:
    """Why this data cannot be drawn on the device, whatever the memory (before any file is
    read)."""
    if streaming:
        return "the training data is streamed from shards"
    if not small_in_memory(source):
        return held_photos.unfit_reason(source, transform)
    if transform.policy is not None:
        return "--auto-augment's policy works on the host, one image at a time"
    if not transform.can_place(source.images.shape):
        return "its resize (--crop-pct, --crop-mode, --interpolation) is timm's, on the host"
    return None


def _photos_unfit(found: held_photos.PhotoScan, auto: bool) -> Optional[str]:
    """Why scanned photos are not held: images the small-image path crops; for auto, files
    the device decoder does not take (this process would decode them at the start)."""
    unfit = held_photos.small_images_reason(found)
    others = len(found.shapes) - found.jpegs
    if unfit is None and auto and others > AUTO_HOST_DECODED * len(found.shapes):
        unfit = (f"{others} of its {len(found.shapes)} files are not JPEGs the device decodes "
                 f"(the training process would decode them at the start)")
    return unfit


def choose(mode: str, source: ImageSource, transform: ImageTransform, cuda: bool,
           streaming: bool, memory: Optional[int] = None, workers: int = 0,
           rates: Optional[Callable[[], dict]] = None) -> tuple[bool, str]:
    """(whether the training set is held on the device, why: for the run's summary).  `mode`
    is --data-on-device; `memory` the device's bytes (read from CUDA when None and needed);
    `workers` the run's loader workers (they draw --reprob's erasing plans, and photographs'
    crops).  `always` on data this path cannot hold is bad input: a UsageError naming what is
    missing.

    Small images in memory are held as they are; photographs (files, or arrays above
    SMALL_IMAGE px) decoded on the device at the start (held_photos.py), their headers read
    first for their size, where auto reads them only when a few images' sizes promise a fit.
    auto holds photographs that fit only where cropping them on the device trains faster than
    the other paths would (`held_wins`, on `rates()`: img/s measured at the start)."""
    flag = f"--data-on-device {mode}"
    if mode == "never":
        return False, f"a DataLoader ({flag})"
    unfit = _unfit(source, transform, streaming)
    photos = not small_in_memory(source)
    if unfit is None and mode == "always" and photos:
        unfit = _photos_unfit(held_photos.scan(source), auto=False)
    if unfit and mode == "always":
        raise UsageError(f"{flag}: {unfit}; use --data-on-device auto or never")
    if unfit:
        return False, f"a DataLoader ({flag}: {unfit})"
    what = "the training photos decoded once and held there" if photos else \
        "the training set held there"
    if mode == "always":
        size = held_bytes(source, photos)
        return True, f"drawn on the device, {what} ({gb(size)}; {flag})"
    if not cuda:
        return False, f"a DataLoader ({flag}: not on a CUDA device)"
    if photos and workers == 0:  # (DevicePhotoBatches says what they cost)
        return False, (f"a DataLoader ({flag}: each photograph's crop, flips and jitter are "
                       f"timm's draws on the host, and with --num-workers 0 the training "
                       f"process would draw them)")
    if transform.erases and workers == 0:
        # Its plan is timm's draws image by image on the host: without workers to draw them,
        # the training process would, a few times a GPU step's time for each batch.  With
        # workers the device path never asks more of them than a DataLoader would: the same
        # plans, without the pixels' crop, flip and copy.
        return False, (f"a DataLoader ({flag}: --reprob's erasing is drawn image by image on "
                       f"the host, and with --num-workers 0 the training process would draw "
                       f"it)")
    memory = device_memory() if memory is None else memory
    if photos and isinstance(source, HFSource):
        # Reading every file's header costs a read of every file: not for a set that a few
        # images' sizes put far over the line (ImageNet's 1.28 million files).
        estimate = guessed_bytes(source)
        if estimate > SCAN_MARGIN * MEMORY_SHARE * memory:
            return False, (f"a DataLoader ({flag}: the training set's about {gb(estimate)} "
                           f"decoded is over {MEMORY_SHARE:.0%} of the device's {gb(memory)})")
        unfit = _photos_unfit(held_photos.scan(source), auto=True)
        if unfit:
            return False, f"a DataLoader ({flag}: {unfit})"
    size = held_bytes(source, photos)
    if size > MEMORY_SHARE * memory:
        return False, (f"a DataLoader ({flag}: the training set's {gb(size)} is over "
                       f"{MEMORY_SHARE:.0%} of the device's {gb(memory)})")
    fits = f"{gb(size)}, within {MEMORY_SHARE:.0%} of its {gb(memory)}"
    if photos:
        wins, figures = held_wins(rates())
        if not wins:
            return False, f"a DataLoader ({flag}: {fits}, but {figures})"
        return True, f"drawn on the device, {what} ({fits}; {flag}: {figures})"
    return True, f"drawn on the device, {what} ({fits}; {flag})"


def held_wins(rates: dict) -> tuple[bool, str]:
    """Whether held photographs train faster than the files decoded every epoch, and the
    figures why.  `rates` (img/s, as device_decode.time_paths measures them, and "held"):
    held, the device cropping held photos (`held_photos.timed_rate`), then training them in
    turn, 1 / (1/train + 1/held) (the workers' draws keep up: a few percent of what decoding
    asks of them); else the loader workers alone, min(train, host), or, where the device can
    decode the files ("device" measured), the device decode path at its best share
    (device_decode.loop_rate).  Holding wins ties: it frees the workers and the host."""
    train = rates["train"]
    held = 1 / (1 / train + 1 / rates["held"]) if rates["held"] > 0 else 0.0
    other = min(train, rates["host"])
    if "device" in rates:
        other = max(other, loop_rate(best_share(rates), rates))
    figures = (f"cropping the held photos there at {rates['held']:,.0f} img/s beside training "
               f"at {train:,.0f} img/s: {held:,.0f} against {other:,.0f} img/s decoding them "
               f"every epoch")
    return held >= other, figures


def held_bytes(source: ImageSource, photos: bool) -> int:
    """What holding a source on the device takes: small images as stored (`stored_bytes`),
    photographs decoded (their pixels, labels and marks)."""
    if not photos:
        return stored_bytes(source)
    return held_photos.scan(source).pixel_bytes + 2 * 8 * len(source)


def guessed_bytes(source: ImageSource) -> int:
    """The decoded RGB pixels of a source of files as its probed images' sizes put them (the
    ones decoded for --image-size's default), without reading the others."""
    shapes = source.probed_shapes
    return int(len(source) * 3 * sum(h * w for h, w in shapes) / max(1, len(shapes)))


class DeviceResidentBatches:
    """The training set on the device and an epoch's micro-batches drawn from it, from the
    loader's position on (`epoch`, `samples_in_epoch`).  loading.py adds the saved position."""

    name = "train_loader"
    places = True  # the stored pixels are resized, cropped and flipped by `finish`, on the device

    def __init__(self, source: ArraySource, transform: ImageTransform, sampler: EpochSampler,
                 batch_size: int, num_processes: int, rank: int, seed: int,
                 plan_loader: PlanLoaderMaker):
        """`plan_loader` makes the DataLoader that draws --reprob's erasing plans, and held
        photographs' draws (the run's loader workers)."""
        self.source, self.transform, self.sampler = source, transform, sampler
        self.batch_size, self.num_processes, self.rank, self.seed = (batch_size, num_processes,
                                                                     rank, seed)
        self.per_micro_step = batch_size * num_processes
        self.finish = FinishOnDevice(transform, places=self.places)
        self.epoch, self.samples_in_epoch = 0, 0
        self.device = torch.device("cpu")
        self._hold()
        self.warn = lambda text: print(f"warning: {text}", file=sys.stderr)  # the trainer's
        # The shape TrainImages draws erasing for: the placed pixels (the size the model sees).
        shape = torch.Size((batch_size, self.channels, transform.image_size,
                            transform.image_size))
        plans = self._plans(shape)
        self.ahead = PlansAhead(plans, plan_loader) if plans is not None else None

    def _plans(self, shape: torch.Size):
        """What the loader workers draw for each micro-batch (a Dataset of (epoch, k)), or
        None: here --reprob's erasing plans."""
        if not self.transform.erases:
            return None
        return ErasingPlans(self.transform, self.sampler, shape, self.seed, self.num_processes,
                            self.rank)

    @property
    def usable(self) -> int:
        return self.sampler.usable

    def __len__(self) -> int:
        return self.usable // self.per_micro_step

    @property
    def channels(self) -> int:
        return self.source.images.shape[1]

    def prepare(self, accelerator) -> None:
        """The one copy of the data to the device (Accelerate's)."""
        self.device = accelerator.device
        self._hold()

    def _hold(self) -> None:
        """The stored pixels and labels on `self.device`."""
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
        """This rank's micro-batches of the epoch from the `first` on: (sample indices [count,
        B] as device tensors, what `_samples` needs beside them: the crop plans [count, B, 3]
        as device tensors, or None)."""
        epoch, count = self.epoch, len(self) - first
        indices = self._rank_indices(first)
        flat = indices.reshape(-1).numpy()
        epochs = np.full_like(flat, epoch)
        crops = self.transform.crop_plan(self.seed, epochs, flat)            # [count * B, 3]
        if crops is not None:
            crops = self._to_device(crops.view(count, self.batch_size, 3))
        return self._to_device(indices), crops

    def _rank_indices(self, first: int) -> torch.Tensor:
        """Host int64 [count, B]: this rank's micro-batches of the epoch from the `first` on."""
        return self.sampler.rank_batches(self.epoch, self.num_processes, self.batch_size,
                                         self.rank)[first:]

    def _samples(self, k: int, chosen: torch.Tensor, plan,
                 drawn: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The k-th micro-batch of the pass, whose samples are `chosen` (on the device), and
        what the workers drew for it (`_plans`' item, host tensors): (pixels, labels, marks of
        replaced samples, the plans FinishOnDevice reads)."""
        crop = () if plan is None else (plan[k],)
        return (self.images.index_select(0, chosen), self.labels.index_select(0, chosen),
                self.replaced, crop + tuple(self._to_device(part) for part in drawn))

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the epoch; every operation is queued on the device, none waits for it."""
        first = self.samples_in_epoch // self.per_micro_step
        if first >= len(self):
            return
        indices, plan = self._epoch_plan(first)
        count = len(indices)
        drawn = self.ahead.each(self.epoch, first, len(self)) if self.ahead is not None \
            else itertools.repeat(())
        offset = self.epoch * len(self.source)
        # (range first: zip takes no draws past the epoch's last batch)
        items = ((k, indices[k], each) for k, each in zip(range(count), drawn))
        for k, (pixels, labels, replaced, plans) in enumerate(self._made(items, count, plan)):
            keys = indices[k] + offset
            # Counted as handed out: a checkpoint after this batch's step includes it.
            self.samples_in_epoch += self.per_micro_step
            yield Batch(self.finish(pixels, plans), labels, keys, replaced)

    def _made(self, items: Iterator[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]],
              count: int, plan) -> Iterator[tuple[torch.Tensor, ...]]:
        """`_samples` of each of the pass's `count` items (k, chosen, drawn), in order."""
        for k, chosen, drawn in items:
            yield self._samples(k, chosen, plan, drawn)


class DevicePhotoBatches(DeviceResidentBatches):
    """Photographs decoded once into the device's memory at `prepare` (held_photos.py), and an
    epoch's micro-batches cropped there from them: timm's draws for each sample made by the
    loader workers ahead of the loop (`held_photos.PhotoPlans`: about 0.14 ms an image on one
    core of an AMD EPYC, 35 ms a batch of 256, a large share of an H200's ResNet-50 step had
    the training process drawn them), then the device decode path's crop, resize, flips and
    jitter, queued on the device without waiting for it."""

    channels = 3  # held RGB
    places = False  # the crops are made before `finish`, from the held photos

    def _hold(self) -> None:
        # Decoding waits for `prepare` and its device: one decode of every photo, not two.
        self.held: Optional[held_photos.HeldPhotos] = None
        self.crops_ahead = DecodeAhead()

    def _plans(self, shape: torch.Size) -> held_photos.PhotoPlans:
        self.photo_plans = held_photos.PhotoPlans(self.transform, self.sampler, shape,
                                                  self.seed, self.num_processes, self.rank)
        return self.photo_plans

    def prepare(self, accelerator) -> None:
        self.device = accelerator.device
        self.side = SideStream(self.device)
        self.held = held_photos.hold(self.source, self.device)
        # (before the plans' workers start: they draw each crop for its photo's size)
        self.photo_plans.sizes = self.held.sizes()

    def _epoch_plan(self, first: int):
        if self.held is None:  # (the plans' workers would start without the photos' sizes)
            raise RuntimeError("DevicePhotoBatches: prepare(accelerator) decodes the photos "
                               "before the first batch")
        return self._to_device(self._rank_indices(first)), None

    def _made(self, items, count: int, plan) -> Iterator[tuple[torch.Tensor, ...]]:
        # The crops of batch k+1 queued by a thread while the trainer runs batch k's step
        # (decode_ahead.py): made in line, their host half (the gather's tables, a launch a
        # kernel) ran after the step's launches and their kernels after the step's.
        return self.crops_ahead.batches(items, count, self._crops_started,
                                        self._crops_handed_over)

    def _crops_started(self, item: tuple) -> tuple:
        """On the thread: the micro-batch's crops queued (on a GPU, on a side stream)."""
        _, chosen, drawn = item
        parts = self.photo_plans.parts
        pixels, done = self.side.run(
            lambda: self.held.crops(self.transform.image_size, drawn[:parts]))
        return pixels, done, chosen, drawn[parts:]

    def _crops_handed_over(self, started: tuple) -> tuple[torch.Tensor, ...]:
        """In the training thread: (pixels, labels, marks, the erasing plans)."""
        pixels, done, chosen, erasing = started
        return (taken_over(pixels, done), self.held.labels.index_select(0, chosen),
                self.held.replaced.index_select(0, chosen),
                tuple(self._to_device(part) for part in erasing))
