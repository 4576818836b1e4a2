"""Training photographs decoded once and held on the device, each batch cropped there.

Why: photo data sets such as Oxford-IIIT Pets (7,349 photos, about 4 GB decoded) or
Flowers-102 fit in a tenth of a large GPU's memory.  Decoded there once, every epoch trains
without decoding at all: no loader workers, no copy of images per step, where decoding JPEGs at
ImageNet sizes each epoch is what makes a GPU wait (device_decode.py says by how much).

The same samples as the device decode path (--decode-on-device, device_decode.py), itself the
loader workers' path within the decoders' rounding: each photo decoded by the same decoder with
its EXIF orientation applied, each sample's draws timm's own for its (seed, epoch, index)
(`draw_plans`), then the same crop and resize, flips and colour jitter on the device
(`resized_crops`, `flipped`, `jitter`).  Files the device decoder does not take (not JPEG,
CMYK, refused) are decoded once on the host, and a file that cannot be decoded at all holds its
substitute (--bad-images substitute: the source's own choice), with that image's label; its
samples carry the loader's marks (badimages.py names them).  Images of 64 px or less take the
small-image crop, which this path does not make: data holding them is not held here.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from accel_train.data.batched_resize import on_device, resized_crops
from accel_train.data.decode import Unreadable, jpeg_header, pil_size
from accel_train.data.device_erasing import ErasingPlans
from accel_train.data.device_decode import (PROBE_IMAGES, decode_jpegs, draw_plans, flipped,
                                            jitter, transform_unfit)
from accel_train.data.jpeg_decoders import jpeg_decoder, missing
from accel_train.data.sources import ArraySource, HFSource, ImageSource, spread
from accel_train.data.transforms import SMALL_IMAGE, ImageTransform

SCAN_BATCH = 256  # files read at once while their headers are read and while decoding them
# draw_plans' parts, in the order PhotoPlans hands them over (the jitter's where it is on)
PLAN_PARTS = ("boxes", "bicubic", "mirrored", "upside_down", "jitter_order", "jitter_factors")


@dataclass(frozen=True)
class PhotoScan:
    """What the files' headers say of a training set, before anything is decoded."""

    shapes: list[Optional[tuple[int, int]]]  # (height, width) of each; None: unreadable
    # each file's EXIF orientation where the device decoder takes it (device_decode's JPEGs),
    # None where the host decodes it
    turns: list[Optional[int]]

    @property
    def jpegs(self) -> int:
        """The files the device decoder takes."""
        return sum(turn is not None for turn in self.turns)

    @property
    def pixel_bytes(self) -> int:
        """The decoded RGB pixels' bytes (a substitute's are not counted)."""
        return sum(3 * height * width for height, width in filter(None, self.shapes))

    @property
    def small(self) -> int:
        """Images of SMALL_IMAGE px or less, whose crop is the small-image one."""
        return sum(1 for shape in self.shapes if shape is not None and max(shape) <= SMALL_IMAGE)


@functools.lru_cache(maxsize=2)  # asked before the start-up's timings, and again after them
def scan(source: ImageSource) -> PhotoScan:
    """Each training image's size from its file's header (a JPEG's with its EXIF orientation
    applied; the others' as PIL reads them, the same area), without decoding any."""
    if isinstance(source, ArraySource):
        return PhotoScan([tuple(source.images.shape[-2:])] * len(source), [None] * len(source))
    shapes: list[Optional[tuple[int, int]]] = []
    turns: list[Optional[int]] = []
    for start in range(0, len(source), SCAN_BATCH):
        for item in source.files_at(range(start, min(start + SCAN_BATCH, len(source)))):
            header = jpeg_header(item) if isinstance(item, bytes) else None
            turns.append(None if header is None else header[2])
            if header is not None:
                shapes.append(header[:2])
            elif isinstance(item, Unreadable):
                shapes.append(None)
            else:
                try:
                    width, height = pil_size(item)
                    shapes.append((height, width))
                except Exception:  # noqa: BLE001 -- decoding it names the problem (substitute)
                    shapes.append(None)
    return PhotoScan(shapes, turns)


def unfit_reason(source: ImageSource, transform: ImageTransform) -> Optional[str]:
    """Why these training photos cannot be held and cropped on the device, whatever its memory
    (None if they can); `scan` says more once read."""
    per_step = "the training images are decoded per step, not held in memory (--in-memory)"
    if not isinstance(source, (ArraySource, HFSource)):  # a program's own data set
        return per_step
    unfit = transform_unfit(transform)
    if unfit:
        return unfit
    if isinstance(source, HFSource) and source.native_size <= SMALL_IMAGE:  # CIFAR's files
        return per_step
    if isinstance(source, HFSource) and jpeg_decoder() is None:
        return missing()
    return None


def small_images_reason(found: PhotoScan) -> Optional[str]:
    """Why a scanned set cannot be held here: some of its images take the small-image crop."""
    if not found.small:
        return None
    return (f"{found.small} of its images are {SMALL_IMAGE} px or less, whose crop is the "
            f"small-image path's, not the photographs'")


@dataclass
class HeldPhotos:
    """Every training photo decoded on one device: uint8 [3, H, W] views into one buffer
    (substitutes held again), the label and the loader's mark of each (-1, or its own index
    where its file was replaced)."""

    images: list[torch.Tensor]
    labels: torch.Tensor    # int64 [N] on the device
    replaced: torch.Tensor  # int64 [N] on the device
    seconds: float = 0.0    # what reading and decoding them all took, the device waited for

    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) of each held image: what its crop is drawn for."""
        return [tuple(image.shape[-2:]) for image in self.images]

    def crops(self, size: int, drawn: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """uint8 [B, 3, size, size] on the device: the held images of a micro-batch cropped,
        resized, flipped and colour-jittered as `PhotoPlans` drew them (`drawn`: its item's
        first `parts`, the sample indices first), the device decode path's steps on held
        pixels in place of decoded ones."""
        indices, boxes, bicubic, mirrored, upside_down, *jitter_plan = drawn
        device = self.labels.device
        images = [self.images[index] for index in indices.tolist()]
        crops = resized_crops(images, boxes, size, bicubic, device)
        crops = flipped(crops, mirrored, upside_down, batched=device.type != "cpu")
        if jitter_plan:
            order, factors = jitter_plan
            crops = jitter(crops, on_device(order, device), on_device(factors, device))
        return crops


class PhotoPlans(ErasingPlans):
    """Item (epoch, k): what the device needs to crop rank `rank`'s k-th micro-batch of that
    epoch from the held photos, drawn by a loader worker: the sample indices, then timm's draws
    for each (`draw_plans`: crop box, bicubic, flips; the jitter's order and factors where
    --color-jitter is on), `parts` tensors in all, then --reprob's erasing plan where on.
    `sizes` (each held image's, `HeldPhotos.sizes`) is set before the workers start."""

    sizes: list[tuple[int, int]] = []

    @property
    def parts(self) -> int:
        return 7 if self.transform.color_jitter else 5

    def __getitem__(self, position: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        epoch, k = position
        indices = self.batch_indices(epoch)[k]
        drawn = photo_draws(self.transform, self.seed, epoch, indices,
                            [self.sizes[index] for index in indices])
        if self.transform.erases:
            drawn += tuple(super().__getitem__(position))
        return drawn


def photo_draws(transform: ImageTransform, seed: int, epoch: int, indices: np.ndarray,
                sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """`PhotoPlans`' first parts for the samples (epoch, index) of images of `sizes`."""
    plans = draw_plans(transform, seed, np.full(len(indices), epoch), indices, sizes)
    return (torch.from_numpy(np.asarray(indices, dtype=np.int64)),
            *(plans[name] for name in PLAN_PARTS if plans[name] is not None))


def timed_rate(source: ImageSource, transform: ImageTransform, seed: int,
               device: torch.device) -> float:
    """Images a second `device` crops, resizes, flips and jitters held photos at (`HeldPhotos.
    crops`, the draws made beforehand as the workers make them): PROBE_IMAGES of the source's
    images spread over it (the JPEGs among them decoded there), their crops timed, the best of
    two (the first pays its start-up), waiting for the device.  0 where none of them decodes
    there."""
    device = torch.device(device)
    probed = spread(min(PROBE_IMAGES, len(source)), len(source))
    if isinstance(source, ArraySource):
        images = list(source.images[probed].to(device).unbind(0))
    else:
        blobs, turns = [], []
        for item in source.files_at(probed):
            header = jpeg_header(item) if isinstance(item, bytes) else None
            if header is not None:
                blobs.append(torch.frombuffer(bytearray(item), dtype=torch.uint8))
                turns.append(header[2])
        images = [image for image in decode_jpegs(blobs, turns, device)[0] if image is not None]
    if not images:
        return 0.0
    marks = torch.full((len(images),), -1, dtype=torch.int64, device=device)
    held = HeldPhotos(images, marks, marks)
    drawn = photo_draws(transform, seed, 0, np.arange(len(images)), held.sizes())
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = math.inf
    for _ in range(2):
        wait()
        started = time.perf_counter()
        held.crops(transform.image_size, drawn)
        wait()
        seconds = min(seconds, time.perf_counter() - started)
    return len(images) / seconds


def hold(source: ImageSource, device: torch.device) -> HeldPhotos:
    """Every image of `source` decoded once into `device`'s memory (`scan`'s sizes decide the
    buffer, its orientations where to turn them): JPEGs by the device decode path's decoder,
    SCAN_BATCH at a time, the others and any it refuses on the host, as the loader would (the
    source's substitute for a file that cannot be decoded)."""
    device = torch.device(device)
    started = time.perf_counter()
    labels = source.labels.clone()
    replaced = torch.full((len(source),), -1, dtype=torch.int64)
    if isinstance(source, ArraySource):  # decoded already: one copy
        held = source.images.to(device)
        return HeldPhotos(list(held.unbind(0)), labels.to(device), replaced.to(device),
                          _seconds_since(started, device))
    found = scan(source)
    buffer = torch.empty(found.pixel_bytes, dtype=torch.uint8, device=device)
    images: list[Optional[torch.Tensor]] = []
    on_host: list[int] = []
    start = 0
    for first in range(0, len(source), SCAN_BATCH):
        indices = range(first, min(first + SCAN_BATCH, len(source)))
        blobs, places, turns = [], [], []
        for index, item in zip(indices, source.files_at(indices)):
            shape = found.shapes[index]
            slot = None
            if shape is not None:  # its place in the buffer, whoever decodes it
                slot = buffer[start:start + 3 * shape[0] * shape[1]].view(3, *shape)
                start += slot.numel()
            images.append(slot)
            if found.turns[index] is None:
                on_host.append(index)
                continue
            blobs.append(torch.frombuffer(bytearray(item), dtype=torch.uint8))
            places.append(index)
            turns.append(found.turns[index])
        for index, image in zip(places, decode_jpegs(blobs, turns, device)[0]):
            if image is None or image.shape != images[index].shape:
                on_host.append(index)  # refused, or read otherwise than its header
            else:
                images[index].copy_(image)
    for index in sorted(on_host):
        (image,), (used,) = source.samples_at([index])
        image = image.to(device)
        if images[index] is not None and images[index].shape == image.shape:
            images[index].copy_(image)
        else:  # a substitute, or another size than its header said: held apart
            images[index] = image
        if used != index:
            labels[index], replaced[index] = source.labels[used], index
    return HeldPhotos(images, labels.to(device), replaced.to(device),
                      _seconds_since(started, device))


def _seconds_since(started: float, device: torch.device) -> float:
    """Seconds from `started` to the end of the work queued on `device` (a wait once, at the
    start: the summary says what holding the photos cost)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
