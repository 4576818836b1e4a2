"""Torch datasets, the epoch sampler and DataLoaders (before `accelerator.prepare`).

Data order is a function of (seed, epoch) only.  The training sampler yields keys
`epoch * N + index` so that the dataset (possibly in a persistent worker process that never sees
`set_epoch`) knows the epoch for its seeded augmentation.  Each epoch is cut to a whole number of
*global* batches (batch x processes x accumulation): every optimizer step then sees exactly one
global batch, whatever the world size, which is what lets a run resume on a different number of
processes and still use each sample of the interrupted epoch exactly once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from accel_train.data.augment import build_erasing, build_policy
from accel_train.data.device_decode import encode_batch
from accel_train.data.loader_watch import reading
from accel_train.base.randomness import DATASET_READ_SALT, loader_generator, seeded
from accel_train.data.sources import ArraySource, ImageSource, spread
from accel_train.data.transforms import (ImageTransform, held_out_crop, held_out_transform,
                                         single_threaded)
from accel_train.data.worker_start import worker_context, worker_init_fn

STATS_SAMPLE = 5000  # images used to estimate the dataset's mean/std
STATS_CHUNK = 256  # images converted to float64 at a time for them
# --decode-on-device auto times the loader's workers together: each decodes this many batches
# of this many images in the timed pass (a few tenths of a second at ImageNet sizes)
RATE_BATCH, RATE_BATCHES_EACH = 8, 4


class Batch(NamedTuple):
    """One micro-batch of training, from either train loader (loading.py, streaming/)."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: torch.Tensor      # sampler keys epoch * N + index: which samples these are
    replaced: torch.Tensor  # per sample, its index where its image was replaced, else -1


class SampleBatch(Sequence):
    """The (image, label[, key][, replaced]) samples of one batch, built as a batch: a sequence
    of samples to any reader (default_collate included), while `collate_batch` hands the loader
    the stacked tensors it already holds, with no unbinding and re-stacking, followed by the
    batch's erasing plan when there is one (`ImageTransform.erasing_plan`: a batch's, not a
    sample's)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor,
                 keys: torch.Tensor | None = None, replaced: torch.Tensor | None = None,
                 erasing: tuple[torch.Tensor, torch.Tensor] | None = None,
                 crop_plan: torch.Tensor | None = None):
        self.images, self.labels, self.keys, self.replaced = images, labels, keys, replaced
        self.erasing, self.crop_plan = erasing, crop_plan

    def __len__(self) -> int:
        return len(self.labels)

    def samples_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.images, self.labels, self.keys, self.replaced)
                     if t is not None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The samples' tensors, then the crop plan of images placed on the device (if so),
        then the erasing plan (if any): the order `FinishOnDevice` reads them in."""
        plan = () if self.crop_plan is None else (self.crop_plan,)
        return self.samples_tensors() + plan + tuple(self.erasing or ())

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(len(self))[position]]
        return tuple(tensor[position] for tensor in self.samples_tensors())


def collate_batch(samples):
    if isinstance(samples, SampleBatch):
        return samples.tensors()
    return default_collate(samples)


def replaced_marks(indices: torch.Tensor, used: list[int]) -> torch.Tensor:
    """Per sample, its index where its own image could not be decoded (a substitute's image and
    label stand in its place: sources.py), else -1.  The loader carries these back from its
    worker processes, so that the training process can name each broken image once."""
    used = torch.as_tensor(used, dtype=torch.long)
    return torch.where(used != indices, indices, torch.full_like(indices, -1))


class TrainImages(Dataset):
    """Indexed by sampler keys `epoch * N + index`; returns (uint8 pixels, label, key), and with
    `mark_replaced` a fourth element, the sample's index if its image was replaced else -1
    (`replaced_marks`).  The pixels are resized, cropped, flipped and put through the policy
    (`ImageTransform.pixel_batch`); normalizing and erasing wait for the device
    (`FinishOnDevice`): a loader moves a quarter of float32's bytes, and a GPU does that work.

    The key rides along to the training loop, which hands each micro-batch's keys to whoever
    wants to know exactly which samples were trained on (the loader prefetches, so the sampler's
    own order says what was *fetched*, not what was trained before a stop).

    The DataLoader asks for a whole batch of keys at once (`__getitems__`): in-memory images are
    then gathered and augmented as one tensor, which keeps the input pipeline a small fraction of
    a training step without worker processes (see transforms.py).

    `place_on_device` (a GPU's runs): small in-memory images without --auto-augment leave as
    they are stored, with their crop plan, and are resized, cropped and flipped on the device
    (`FinishOnDevice`): CIFAR trained at 224 or 336 px (the seed tutorial's ResNet-50d) would
    otherwise have the host's cores upscale every image, 50-110 times its stored pixels, and the
    GPU wait for them (BENCHMARKS.md, "GPU: one NVIDIA H200, a second time")."""

    def __init__(self, source: ImageSource, transform: ImageTransform, seed: int,
                 mark_replaced: bool = False, place_on_device: bool = False,
                 decode_on_device: bool = False):
        self.source, self.transform, self.seed = source, transform, seed
        self.mark_replaced = mark_replaced
        self.places_on_device = (place_on_device and isinstance(source, ArraySource)
                                 and transform.can_place(source.images.shape))
        # JPEG bytes and their draws out, decoded and cropped on the device (device_decode.py),
        # but for this share of them, decoded here (--host-decode-share)
        self.decodes_on_device = decode_on_device
        self.host_decode_share = 0.0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self.source))
        pixels, used = self.host_sample(epoch, index)
        sample = (pixels, self.source.labels[used], int(key))
        return (*sample, index if used != index else -1) if self.mark_replaced else sample

    @single_threaded
    def __getitems__(self, keys: list[int]):
        if self.decodes_on_device:
            return self.encoded_batch(keys)
        return self.host_batch(keys)

    def encoded_batch(self, keys: list[int]) -> SampleBatch:
        """The batch as JPEG bytes and draws (`device_decode.EncodedImages`) in place of pixels;
        what the device cannot decode is finished here, as `host_batch` would."""
        keys = torch.as_tensor(keys, dtype=torch.long)
        epochs, indices = (keys // len(self.source)).numpy(), (keys % len(self.source)).numpy()

        def host_samples(positions: list[int]):
            done = [self.host_sample(int(epochs[k]), int(indices[k])) for k in positions]
            return torch.stack([pixels for pixels, _ in done]), [used for _, used in done]

        encoded, labels, used = encode_batch(self.source, self.transform, self.seed, epochs,
                                             indices, host_samples, self.host_decode_share)
        marks = replaced_marks(torch.from_numpy(indices), used) if self.mark_replaced else None
        shape = (len(keys), 3, self.transform.image_size, self.transform.image_size)
        return SampleBatch(encoded, labels, keys, marks,
                           self._erasing(shape, torch.from_numpy(epochs),
                                         torch.from_numpy(indices)))

    def host_sample(self, epoch: int, index: int) -> tuple[torch.Tensor, int]:
        """One training image decoded and augmented here: (uint8 [3, S, S], the index whose
        image it is: a substitute's when its own cannot be decoded)."""
        (image,), (used,) = self.read([epoch], [index])
        return self.transform.pixels(image, (self.seed, epoch, index)), used

    def read(self, epochs, indices) -> tuple[list[torch.Tensor], list[int]]:
        """The samples at `indices` as the source gives them.  A program's dataset with a random
        transform of its own (user_data.py) draws from the global generators as it reads: each
        read is seeded by its sample's place in the run, as the run's own augmentation is, so
        that the draws do not depend on the worker or on what it read before (exact resume)."""
        if not self.source.reads_randomly:
            return read_samples(self.source, list(indices))
        images, used = [], []
        for epoch, index in zip(epochs, indices):
            with seeded(self.seed, int(epoch), int(index), DATASET_READ_SALT):
                (image,), (one,) = read_samples(self.source, [int(index)])
            images.append(image)
            used.append(one)
        return images, used

    def host_batch(self, keys: list[int]) -> SampleBatch:
        """The batch decoded (if stored encoded) and augmented here, in a loader worker."""
        keys = torch.as_tensor(keys, dtype=torch.long)
        epochs, indices = keys // len(self.source), keys % len(self.source)
        marks = torch.full_like(indices, -1) if self.mark_replaced else None
        if not isinstance(self.source, ArraySource):  # decoded now
            # A replaced sample keeps its own index's augmentation: a function of the index.
            images, used = self.read(epochs.tolist(), indices.tolist())
            batch = self.transform.pixel_list(images, self.seed, epochs.numpy(),
                                              indices.numpy())
            if marks is not None:
                marks = replaced_marks(indices, used)
            return SampleBatch(batch, self.source.labels[used], keys, marks,
                               self._erasing(batch.shape, epochs, indices))
        images, plan = self.source.images.index_select(0, indices), None
        if self.places_on_device:  # placed on the device: the plans are drawn for its size
            plan = self.transform.crop_plan(self.seed, epochs.numpy(), indices.numpy())
            placed = (*images.shape[:2], self.transform.image_size, self.transform.image_size)
        else:
            images = self.transform.pixel_batch(images, self.seed, epochs.numpy(),
                                                indices.numpy())
            placed = images.shape
        return SampleBatch(images, self.source.labels[indices], keys, marks,
                           self._erasing(placed, epochs, indices), crop_plan=plan)

    def _erasing(self, shape, epochs: torch.Tensor, indices: torch.Tensor):
        """The erasing plan (--reprob) of a batch of placed pixels of `shape`, drawn here: in
        the loader's workers, beside the training step rather than in its way
        (`FinishOnDevice`)."""
        return self.transform.erasing_plan(torch.Size(shape), self.seed, epochs.numpy(),
                                           indices.numpy())


class HeldOutImages(Dataset):
    """Returns (image tensor, label), then with `first_key` the sample's key (`first_key` +
    its index: a position in the data evaluated, for naming each image afterwards), then with
    `mark_replaced` the mark TrainImages' fourth element is.  The image is normalized float; with
    `normalized=False` its uint8 pixels, for the device to finish (`ImageTransform.finish`: a
    quarter of the bytes to move and to keep there)."""

    def __init__(self, source: ImageSource, transform: ImageTransform,
                 mark_replaced: bool = False, first_key: Optional[int] = None,
                 normalized: bool = True):
        self.source, self.transform, self.mark_replaced = source, transform, mark_replaced
        self.first_key, self.normalized = first_key, normalized

    def __len__(self) -> int:
        return len(self.source)

    def _finished(self, pixels: torch.Tensor) -> torch.Tensor:
        """A uint8 [B, 3, S, S] batch as this data set hands it out."""
        return self.transform.finish(pixels) if self.normalized else pixels

    def __getitem__(self, index: int):
        (image,), (used,) = read_samples(self.source, [index])
        sample = self._finished(self.transform.pixels(image).unsqueeze(0))[0], \
            self.source.labels[used]
        if self.first_key is not None:
            sample = (*sample, torch.tensor(self.first_key + index))
        return (*sample, index if used != index else -1) if self.mark_replaced else sample

    @single_threaded
    def __getitems__(self, indices: list[int]):
        indices = torch.as_tensor(indices, dtype=torch.long)
        marks = torch.full_like(indices, -1) if self.mark_replaced else None
        keys = None if self.first_key is None else self.first_key + indices
        if not isinstance(self.source, ArraySource):
            images, used = read_samples(self.source, indices.tolist())
            unseeded = [0] * len(images)  # nothing drawn held out: __call__'s (0, 0, 0)
            batch = self._finished(self.transform.pixel_list(images, 0, unseeded, unseeded))
            if marks is not None:
                marks = replaced_marks(indices, used)
            return SampleBatch(batch, self.source.labels[used], keys=keys, replaced=marks)
        if marks is not None and self.source.bad_images:  # their slots hold substitutes
            bad = torch.tensor(sorted({bad.index for bad in self.source.bad_images}))
            marks = torch.where(torch.isin(indices, bad), indices, marks)
        pixels = self.transform.pixel_batch(self.source.images.index_select(0, indices))
        return SampleBatch(self._finished(pixels), self.source.labels[indices], keys=keys,
                           replaced=marks)


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, cut to a multiple of the global batch, as epoch keys."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, shuffle: bool = True):
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.usable = (num_samples // global_batch) * global_batch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.usable)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)[: self.usable]

    def rank_batches(self, epoch: int, num_processes: int, batch_size: int,
                     rank: int) -> torch.Tensor:
        """Rank `rank`'s micro-batches of `epoch` as sample indices [count, batch_size]: its
        k-th is the order's batch k * processes + rank, as Accelerate's batch-sampler
        sharding hands them out."""
        return self.order(epoch).view(-1, num_processes, batch_size)[:, rank]

    def __iter__(self) -> Iterator[int]:
        offset = self.epoch * self.num_samples
        return iter((self.order(self.epoch) + offset).tolist())

    def __len__(self) -> int:
        return self.usable


def dataset_mean_std(source: ImageSource) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of (a deterministic sample of) the training images, in [0, 1]."""
    count = min(len(source), STATS_SAMPLE)
    if isinstance(source, ArraySource):
        # A few images at a time, in float64: the whole uint8 array as float32 was 4x its
        # bytes, and std another such copy (photos decoded into memory ran out of it).
        total = torch.zeros(3, dtype=torch.float64)
        total_sq = torch.zeros(3, dtype=torch.float64)
        for start in range(0, count, STATS_CHUNK):
            chunk = source.images[start:min(count, start + STATS_CHUNK)].double().div_(255)
            total += chunk.sum(dim=(0, 2, 3))
            total_sq += (chunk * chunk).sum(dim=(0, 2, 3))
        num_pixels = count * source.images.shape[2] * source.images.shape[3]
        mean = total / num_pixels
        # the sample's (n - 1) std, as torch.std gives it
        std = ((total_sq - num_pixels * mean * mean) / max(1, num_pixels - 1)) \
            .clamp_min(1e-12).sqrt()
    else:  # images may differ in size: accumulate per-channel sums
        total = torch.zeros(3, dtype=torch.float64)
        total_sq = torch.zeros(3, dtype=torch.float64)
        num_pixels = 0
        for index in range(min(count, 500)):
            image = source.image(index).double().div_(255)
            total += image.sum(dim=(1, 2))
            total_sq += (image * image).sum(dim=(1, 2))
            num_pixels += image.shape[1] * image.shape[2]
        mean = total / num_pixels
        std = (total_sq / num_pixels - mean * mean).clamp_min(1e-12).sqrt()
    return (tuple(round(float(v), 4) for v in mean),
            tuple(round(float(max(v, 1e-3)), 4) for v in std))


def default_num_workers(source: ImageSource, cores: float, cuda: bool) -> int:
    """On a CPU: no workers for in-memory data (decoding is done; the step needs every core,
    and workers would only add IPC), else a share of the cores, at most 4 per process.  On a
    GPU the step runs on the device, so every core of the process's share but its own prepares
    images, decoded or in memory: a GPU eats them faster than a few cores resize, crop and
    flip them (BENCHMARKS.md, "GPU: one NVIDIA H100": with four, the step still waited for
    in-memory images being resized).  `cores`: this process's share of its machine's cores
    (base.ranks.process_cores)."""
    share = int(cores)  # whole cores
    if isinstance(source, ArraySource):
        return share - 1 if cuda and share > 1 else 0
    if cuda:
        return max(1, share - 1)
    return max(1, min(4, share))


def read_samples(source: ImageSource,
                 indices: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """`source.samples_at(indices)`, noted as the read in progress: a read that gets stuck is
    named by the worker's watch (loader_watch.py)."""
    with reading(lambda: describe_reads(source, indices)):
        return source.samples_at(indices)


def describe_reads(source: ImageSource, indices: list[int]) -> str:
    """The images of one read, for a person: the first one's file (or data file and row)."""
    name = source.name(indices[0]) if hasattr(source, "name") else f"image {indices[0]}"
    return name + (f" (and {len(indices) - 1} more images)" if len(indices) > 1 else "")


def make_loader(dataset: Dataset, batch_size: Optional[int], num_workers: int,
                prefetch_factor: int, persistent_workers: bool, pin_memory: bool,
                sampler: Sampler | None = None, drop_last: bool = False, seed: int = 0,
                timeout: float = 0, collate: Optional[Callable] = collate_batch) -> DataLoader:
    """A DataLoader with its own generator (randomness.py): its iterators' base seeds never
    come from, or move, torch's global generator; its workers leave stop signals to the
    training process and are started from a fork server (worker_start.py).  `timeout`: seconds
    to wait for a batch from the workers (0: forever).  `batch_size` None with `collate` None:
    each item handed over as the dataset made it (torch's default_convert)."""
    extra = {}
    if num_workers > 0:
        extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                     timeout=timeout, multiprocessing_context=worker_context())
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                      drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory,
                      collate_fn=collate, generator=loader_generator(seed),
                      worker_init_fn=worker_init_fn(timeout), **extra)


def end_workers(loader: DataLoader) -> None:
    """Shut down the workers `loader` keeps between passes (persistent workers), now; the next
    pass starts new ones.  Torch would do it when the loader is freed, but only in time when
    the loader is freed by reference count: a run's loaders sit in reference cycles (trainer,
    Accelerator), and the cyclic collector stops the workers' queue feeder threads before the
    iterator's shutdown puts its last message on them, so that torch then waits out a 5-s join
    timeout for each worker (measured: 20 s of one gc.collect() after a finished run with 2
    workers).  Torch has no public call for this (pytorch/pytorch#64766): its kept iterator's
    own shutdown it is."""
    kept = loader._iterator
    if kept is not None:
        kept._shutdown_workers()
        loader._iterator = None


def workers_rate(dataset: "TrainImages", workers: int) -> float:
    """Images a second `workers` loader worker processes decode and augment together (the
    host path --decode-on-device auto weighs against the GPU's), over training keys spread
    over the set (sources.spread); with no workers, this process alone.  Why together: one
    thread's rate times the workers overestimated them 1.6x on an H200 node (15 workers on 16
    logical CPUs, of which SMT siblings share cores, and all share memory bandwidth), and auto
    kept the workers where the GPU was faster."""
    if workers == 0:
        keys = spread(RATE_BATCH * RATE_BATCHES_EACH, len(dataset))
        best = math.inf
        for _ in range(2):  # the first pays its start-up (libraries, caches)
            started = time.perf_counter()
            dataset.__getitems__(keys)  # what a loader without workers fetches
            best = min(best, time.perf_counter() - started)
        return len(keys) / best
    count = workers * RATE_BATCHES_EACH * RATE_BATCH
    # persistent: the timed pass starts with the workers up and their libraries loaded
    loader = make_loader(dataset, RATE_BATCH, workers, prefetch_factor=2,
                         persistent_workers=True, pin_memory=False,
                         sampler=spread(count, len(dataset)))
    for _ in loader:
        pass
    started = time.perf_counter()
    for _ in loader:
        pass
    return count / (time.perf_counter() - started)


class FinishOnDevice:
    """The second half of the training transform (`ImageTransform.finish`: normalize, then
    erase with --reprob), run on a micro-batch's uint8 pixels once they are on the device;
    with `places` (TrainImages.places_on_device) the resize, crop and flip before it
    (`ImageTransform.place`).  The erasing is the plan every training loader draws with the
    pixels (a function of each sample's (seed, epoch, index)), never drawn here: here it would
    take the training process's time, and a host sync a step to read the keys."""

    def __init__(self, transform: ImageTransform, places: bool = False):
        self.transform, self.places = transform, places

    def __call__(self, pixels: torch.Tensor, plans: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """`plans`: what the loader drew with the pixels (`SampleBatch.tensors`' tail): with
        `places` and augmenting, the crop plan first; then, with --reprob, the erasing plan."""
        erasing = plans
        if self.places:
            crop = None
            if self.transform.augment:
                crop, erasing = plans[0], plans[1:]
            pixels = self.transform.place(pixels, crop)
        if not self.transform.erases:
            return self.transform.finish(pixels)
        if not erasing:
            raise ValueError("--reprob: the loader handed over no erasing plan with the pixels "
                             "(ImageTransform.erasing_plan)")
        return self.transform.finish(pixels, erasing=tuple(erasing))


def run_transforms(config, spec) -> tuple[ImageTransform, ImageTransform]:
    """(training, held-out) transforms of a run: the training one augments as the flags say
    (crop and flip, above 64 px timm's crop, flips and colour jitter, then --auto-augment and
    --reprob), the held-out one prepares images as the model's spec records (its size, mean,
    std and crop).  Both data paths (indexed and streamed) build theirs here."""
    augmenting = config.augment
    # timm turns colour jitter off under an augmentation policy, unless it is a '3a' one
    # (timm.data.transforms_factory.transforms_imagenet_train).
    jitter = config.color_jitter if not config.auto_augment or "3a" in config.auto_augment \
        else 0.0
    train_tf = ImageTransform(spec.image_size, spec.mean, spec.std, augment=augmenting,
                              flip=config.flip, crop_pad=config.crop_pad,
                              policy=build_policy(config.auto_augment)
                              if augmenting and config.auto_augment else None,
                              erasing=build_erasing(config.reprob) if augmenting else None,
                              hflip=config.hflip, scale=tuple(config.scale),
                              ratio=tuple(config.ratio), vflip=config.vflip, color_jitter=jitter,
                              train_interpolation=config.train_interpolation,
                              **held_out_crop(spec))
    return train_tf, held_out_transform(spec)
