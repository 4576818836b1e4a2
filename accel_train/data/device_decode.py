"""Training JPEGs decoded on the device (--decode-on-device): the loader workers read the files'
bytes and draw each image's crop, flips and colour jitter; the GPU decodes the batch
(nvJPEG, through torchvision's or TorchCodec's `decode_jpeg`: jpeg_decoders.py) and crops,
resizes, flips and jitters it.

Why: at ImageNet sizes a CPU core decodes and crops a few hundred images a second
(BENCHMARKS.md, "JPEG input at ImageNet sizes, per core"), and a GPU trains ResNet-50 at
thousands: the cores, not the GPU, then set the pace.

The same samples as the loader workers' path (transforms.py, timm's training transform on PIL
images): the draws are timm's and torchvision's own (`RandomResizedCropAndInterpolation.
get_params`, the flips' `torch.rand(1)`, `ColorJitter.get_params`), made in the same order
inside the same per-sample seeding, so each image gets the same box, flips, interpolation and
jitter factors on either path, and a resumed run the same ones again.  The pixels differ by the
decoders' and resizers' rounding: nvJPEG is not libjpeg-turbo, a tensor resize is not PIL's,
and the jitter follows torchvision's tensor arithmetic rather than PIL's ImageEnhance.

What the device cannot take goes the workers' way inside the same batch: files that are not
JPEG, or whose header PIL cannot read, CMYK JPEGs, images of 64 px or less (their crop is the
small-image one) and any file the device decoder refuses (decoded on the host instead, its
substitute found as on the host path under --bad-images substitute).  With --host-decode-share
the workers also take a share of the JPEGs the device could, through the device's own steps on
their CPU (`decoded_crops`), and leave those crops' colour jitter to the device (`encode_batch`
says why).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import time
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from torchvision.transforms import ColorJitter

from accel_train.base.errors import UsageError
from accel_train.base.randomness import each_seeded
from accel_train.data.batched_resize import on_device, resized_crops
from accel_train.data.decode import jpeg_header
from accel_train.data.decode_ahead import SideStream, taken_over
from accel_train.data.jpeg_decoders import each_or_none, jpeg_decoder, missing
from accel_train.data.sources import ArraySource, HFSource, ImageSource, spread
from accel_train.data.transforms import CROP_SALT, SMALL_IMAGE, ImageTransform

MODES = ("auto", "always", "never")
# timm's RandomResizedCropAndInterpolation with interpolation "random" picks one of these
# (timm.data.transforms._RANDOM_INTERPOLATION), in this order.
RANDOM_INTERPOLATIONS = ("bilinear", "bicubic")
DEVICE_INTERPOLATIONS = ("bilinear", "bicubic")  # the ones batched_resize.py computes
PROBE_IMAGES = 32            # images each input path is timed on when auto chooses
# How much faster than the loader workers alone auto's device path must promise to be: its
# rate leaves out what the workers still do for the device's images (read the files, draw
# the crops) and the training process's time handing them to the decoder.
MIN_GAIN = 1.1


@dataclasses.dataclass
class EncodedImages:
    """A training batch as the workers hand it over: JPEG bytes and each image's draws, plus the
    images finished on the host.  Neither a tensor nor a sequence, and without `to`:
    Accelerate's device placement passes it through, so the bytes stay on the host, where the
    decoder reads them; the DataLoader's pin-memory thread calls `pin_memory`."""

    data: torch.Tensor        # uint8: the JPEG files, one after the other
    lengths: list[int]        # bytes of each
    positions: torch.Tensor   # int64 [J]: where each JPEG goes in the batch
    keys: torch.Tensor        # int64 [J, 2]: its (epoch, index), for a host decode if need be
    orientations: torch.Tensor  # int64 [J]: EXIF orientation (1-8), applied after decoding
    sizes: torch.Tensor       # int64 [J, 2]: height, width with the orientation applied
    boxes: torch.Tensor       # int64 [J, 4]: top, left, height, width in the oriented image
    bicubic: torch.Tensor     # bool [J]: resized bicubic (else bilinear)
    mirrored: torch.Tensor    # bool [J]: flipped left-right (the draw, or --flip alternate)
    upside_down: torch.Tensor  # bool [J]: flipped top-bottom (--vflip)
    # ColorJitter's order of its parts and its brightness, contrast and saturation factors:
    # the J JPEGs' rows, then the L shared crops' (below), which the device jitters with them
    jitter_order: Optional[torch.Tensor]    # int64 [J + L, 4]
    jitter_factors: Optional[torch.Tensor]  # float64 [J + L, 3]
    ready: torch.Tensor       # uint8 [K, 3, S, S]: finished on the host
    ready_positions: torch.Tensor  # int64 [K]
    count: int                # images in the batch
    size: int                 # S
    # --host-decode-share's JPEGs, decoded, cropped, resized and flipped by the workers as the
    # device would (`decoded_crops`), their jitter left to the device
    shared: Optional[torch.Tensor] = None            # uint8 [L, 3, S, S]
    shared_positions: Optional[torch.Tensor] = None  # int64 [L]

    def pin_memory(self) -> "EncodedImages":
        """This batch with the pixels finished on the host (`ready`, `shared`) in pinned memory,
        by the DataLoader's pin-memory thread (on a GPU), so that the decoding thread only
        queues their copy to the device: pinning them there cost it a host copy of every
        batch's crops (about 30 MB a batch of 256 at a share of 0.8) on the thread that feeds
        the GPU.  The JPEG bytes stay where they are: the decoder reads them on the host."""
        def pinned(pixels: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return pixels.pin_memory() if pixels is not None and pixels.numel() else pixels
        return dataclasses.replace(self, ready=pinned(self.ready), shared=pinned(self.shared))


class _Shape:
    """Only a size, for timm's get_params, which reads nothing else (torchvision's
    get_image_size takes a tensor's last two dimensions; an expanded one allocates nothing)."""

    @staticmethod
    def of(height: int, width: int) -> torch.Tensor:
        return torch.zeros(1, 1, 1, dtype=torch.uint8).expand(1, height, width)


def draw_plans(transform: ImageTransform, seed: int, epochs, indices,
               sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Each image's crop box, interpolation, flips and jitter: the draws timm's training
    transform makes for it (transforms.ImageTransform._timm_train, same seeding, same order)."""
    from timm.data.transforms import RandomResizedCropAndInterpolation
    scale, ratio = tuple(transform.scale), tuple(transform.ratio)
    hflip = 0.0 if transform.flip == "alternate" else transform.hflip
    jitter = ColorJitter(*(float(transform.color_jitter),) * 3) if transform.color_jitter \
        else None

    def draw(size):
        top, left, height, width = RandomResizedCropAndInterpolation.get_params(
            _Shape.of(*size), scale, ratio)
        interpolation = random.choice(RANDOM_INTERPOLATIONS) \
            if transform.train_interpolation == "random" else transform.train_interpolation
        mirrored = bool(torch.rand(1) < hflip) if hflip > 0 else False
        upside_down = bool(torch.rand(1) < transform.vflip) if transform.vflip > 0 else False
        order, factors = None, None
        if jitter is not None:
            order, *factors = jitter.get_params(jitter.brightness, jitter.contrast,
                                                jitter.saturation, jitter.hue)
            factors = factors[:3]
        return (top, left, height, width), interpolation == "bicubic", mirrored, upside_down, \
            order, factors

    keys = [(seed, int(e), int(i), CROP_SALT) for e, i in zip(epochs, indices)]
    drawn = each_seeded(draw, sizes, keys)
    mirrored = torch.tensor([d[2] for d in drawn], dtype=torch.bool)
    if transform.flip == "alternate" and len(drawn):
        mirrored = transform.alternate_flips(seed, epochs, indices)
    plans = {"boxes": torch.tensor([d[0] for d in drawn], dtype=torch.int64).view(-1, 4),
             "bicubic": torch.tensor([d[1] for d in drawn], dtype=torch.bool),
             "mirrored": mirrored,
             "upside_down": torch.tensor([d[3] for d in drawn], dtype=torch.bool),
             "jitter_order": None, "jitter_factors": None}
    if jitter is not None:
        plans["jitter_order"] = torch.stack([d[4] for d in drawn]) if drawn else \
            torch.zeros(0, 4, dtype=torch.int64)
        plans["jitter_factors"] = torch.tensor([d[5] for d in drawn],
                                               dtype=torch.float64).view(-1, 3)
    return plans


def encode_batch(source: HFSource, transform: ImageTransform, seed: int, epochs: np.ndarray,
                 indices: np.ndarray, host_samples: Callable,
                 host_share: float) -> tuple[EncodedImages, torch.Tensor, list[int]]:
    """A loader worker's half: (the batch's EncodedImages, labels, used indices).  The JPEGs
    the device can take are read, not decoded, but for `host_share` of them (--host-decode-
    share: `shared_with_host`), which are decoded, cropped, resized and flipped here as the
    device would (`decoded_crops` on this CPU), their colour jitter left to the device with the
    rest of the batch's; the others, and a shared one this CPU's decoder refuses, go through
    `host_samples(positions)`, the loader's own path -> (uint8 pixels [K, 3, S, S], used
    indices).

    Why the device's steps and not the loader's own path for the share: that path's colour
    jitter and PIL resize are most of its cost (BENCHMARKS.md, "JPEG input at ImageNet sizes,
    per core": timm's transform makes under half the images a core that decoding and cropping
    tensors make), while the same jitter batched on the GPU is a small part of its time; so a
    worker makes about twice the images of its share a core (AMD EPYC, bench_jpeg_input.py)."""
    blobs, positions, sizes, orientations, host = [], [], [], [], []
    for k, item in enumerate(source.files_at(indices.tolist())):
        header = jpeg_header(item) if isinstance(item, bytes) else None
        if header is None or max(header[:2]) <= SMALL_IMAGE:
            host.append(k)
            continue
        blobs.append(item)
        positions.append(k)
        sizes.append(header[:2])
        orientations.append(header[2])
    plans = draw_plans(transform, seed, epochs[positions], indices[positions], sizes)
    keys = torch.from_numpy(np.stack([epochs[positions], indices[positions]], axis=1)
                            .astype(np.int64)).view(-1, 2)
    columns = (blobs, positions, keys, orientations, sizes, plans)
    shared = shared_with_host(len(blobs), host_share)
    taken = set(shared)
    encoded = _part(columns, [j for j in range(len(blobs)) if j not in taken], len(indices),
                    transform.image_size)
    shared_part = _part(columns, shared, len(indices), transform.image_size)
    shared_crops, refused = decoded_crops(shared_part, torch.device("cpu"))
    kept = sorted(set(range(len(shared))) - set(refused))
    host = sorted(host + [int(shared_part.positions[j]) for j in refused])
    used = indices.tolist()
    if host:
        encoded.ready, host_used = host_samples(host)
        encoded.ready_positions = torch.tensor(host, dtype=torch.int64)
        for k, index in zip(host, host_used):
            used[k] = index
    if kept:
        # (indexing copies the crops, 3 ms a batch of 32 at 224 px: not where all were kept)
        encoded.shared = shared_crops if len(kept) == len(shared) else shared_crops[kept]
        encoded.shared_positions = shared_part.positions[kept]
        if encoded.jitter_order is not None:
            encoded.jitter_order = torch.cat([encoded.jitter_order,
                                              shared_part.jitter_order[kept]])
            encoded.jitter_factors = torch.cat([encoded.jitter_factors,
                                                shared_part.jitter_factors[kept]])
    return encoded, source.labels[used], used


def _part(columns: tuple, rows: list[int], count: int, size: int) -> EncodedImages:
    """The EncodedImages of the JPEGs at `rows` of `columns` (blobs, positions, keys,
    orientations, sizes, plans), nothing finished on the host yet."""
    blobs, positions, keys, orientations, sizes, plans = columns
    index = torch.tensor(rows, dtype=torch.int64)
    data = torch.frombuffer(bytearray(b"".join(blobs[j] for j in rows)), dtype=torch.uint8) \
        if rows else torch.zeros(0, dtype=torch.uint8)
    return EncodedImages(
        data, [len(blobs[j]) for j in rows], torch.tensor([positions[j] for j in rows],
                                                          dtype=torch.int64),
        keys[index], torch.tensor([orientations[j] for j in rows], dtype=torch.int64),
        torch.tensor([sizes[j] for j in rows], dtype=torch.int64).view(-1, 2),
        **{name: None if plan is None else plan[index] for name, plan in plans.items()},
        ready=torch.zeros(0, 3, size, size, dtype=torch.uint8),
        ready_positions=torch.zeros(0, dtype=torch.int64), count=count, size=size)


def shared_with_host(count: int, share: float) -> list[int]:
    """Which of a batch's `count` device JPEGs the workers decode under --host-decode-share
    `share`: floor(count x share) of them, spread evenly (the j-th where the running total
    floor((j + 1) x share) steps up), a function of the batch alone, so a resumed run splits
    its batches as the first start did.

    Why a share: the device path leaves the loader workers' cores idle but for reading files,
    while its decoding, crops and jitter take GPU time from the step; NVIDIA DALI's decoder
    splits its batches so too (`hw_decoder_load`, the share its hardware decoder takes)."""
    return [j for j in range(count) if math.floor((j + 1) * share) > math.floor(j * share)]


@dataclasses.dataclass
class Started:
    """A batch the device decoded and cropped, not yet handed to the trainer."""

    pixels: torch.Tensor   # uint8 [B, 3, S, S] on the device
    refused: list[tuple[int, int, int]]  # (position, epoch, index): files left to the host
    labels: torch.Tensor
    replaced: torch.Tensor
    done: Optional["torch.cuda.Event"]  # after the batch's work on the side stream (GPU)


class DeviceDecoder:
    """The device's half: EncodedImages -> uint8 [B, 3, S, S] on `device`, the same pixels the
    workers' path makes within the decoders' rounding.  `dataset` (loaders.TrainImages) makes
    a file the device decoder refuses the host way (`host_sample`), substitute and all."""

    def __init__(self, device: torch.device, dataset):
        self.device, self.dataset = torch.device(device), dataset
        self._side = SideStream(self.device)

    def __call__(self, batch: EncodedImages, labels: torch.Tensor,
                 replaced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pixels, labels, replaced): the labels and marks change only where a file the device
        refused was replaced by a substitute on the host."""
        return self.hand_over(self.start(batch, labels, replaced))

    def start(self, batch: EncodedImages, labels: torch.Tensor,
              replaced: torch.Tensor) -> "Started":
        """The first half of a call, which another thread may run (decode_ahead.py): the
        batch decoded and cropped, on a GPU queued on a side stream of its own.

        Why a side stream: nvJPEG must not start while work queued on its stream may still
        read memory the caching allocator could hand it (`decode_jpegs`); on the caller's stream
        that meant waiting for the last training step, so decoding and the step ran one after
        the other.  The allocator gives a stream's allocations only blocks freed on that
        stream, so draining the side stream alone keeps nvJPEG off memory in use, and the next
        batch decodes while the GPU trains on this one."""
        # Nothing the side stream reads was made on the caller's: the batch's bytes and draws
        # are host tensors, and the labels are changed in hand_over, on the caller's.
        (pixels, refused), done = self._side.run(lambda: self._decode_and_crop(batch))
        return Started(pixels, refused, labels, replaced, done)

    def hand_over(self, started: "Started") -> tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
        """The second half, in the thread that trains: the caller's stream waits for the
        batch's work (an event, not the host), and the files the device refused are made the
        host way here.  Why here: the host's transform draws its crop from the process's
        random generators, seeded for the image (as in a worker); on the decoding thread that
        seeding would land in the middle of the training step's own draws (dropout, Mixup)."""
        pixels = taken_over(started.pixels, started.done)
        labels, replaced = started.labels, started.replaced
        substitutes = []
        for position, epoch, index in started.refused:
            image, used = self.dataset.host_sample(epoch, index)
            pixels[position] = image.to(self.device)
            if used != index:
                substitutes.append((position, used, index))
        if substitutes:
            labels, replaced = labels.clone(), replaced.clone()
            for position, used, index in substitutes:  # Python numbers: no sync
                labels[position] = int(self.dataset.source.labels[used])
                replaced[position] = index
        return pixels, labels, replaced

    def _decode_and_crop(self, batch: EncodedImages) -> tuple[torch.Tensor,
                                                              list[tuple[int, int, int]]]:
        """The batch's pixels on the device, and (position, epoch, index) of each file the
        device refused, whose place `hand_over` fills the host way."""
        size = batch.size
        out = torch.empty(batch.count, 3, size, size, dtype=torch.uint8, device=self.device)
        if len(batch.ready_positions):
            out[self._sent(batch.ready_positions)] = self._sent(batch.ready)
        crops, refused = decoded_crops(batch, self.device)
        positions = batch.positions
        if batch.shared is not None:  # the workers' share, its jitter still to come
            crops = torch.cat([crops, self._sent(batch.shared)])
            positions = torch.cat([positions, batch.shared_positions])
        if batch.jitter_order is not None and len(positions):
            crops = jitter(crops, self._sent(batch.jitter_order),
                           self._sent(batch.jitter_factors))
        if len(positions):
            out[self._sent(positions)] = crops
        keys, places = batch.keys.tolist(), batch.positions.tolist()
        return out, [(places[k], *keys[k]) for k in refused]

    def _sent(self, tensor: torch.Tensor) -> torch.Tensor:
        return on_device(tensor, self.device)


def decoded_crops(batch: EncodedImages, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(uint8 [J, 3, S, S] on `device`: each of the batch's JPEGs decoded there, cropped,
    resized and flipped as its draws say, the colour jitter not yet applied; the JPEGs the
    decoder refused, zeros in their slots).  The device's part of a batch, and on a loader
    worker's CPU its --host-decode-share."""
    size = batch.size
    if not batch.lengths:
        return torch.zeros(0, 3, size, size, dtype=torch.uint8, device=device), []
    decoded, refused = decode_jpegs(list(batch.data.split(batch.lengths)),
                               batch.orientations.tolist(), device)
    kept = []
    sizes = batch.sizes.tolist()  # once, not a call an image
    for k, image in enumerate(decoded):
        if image is not None and list(image.shape[-2:]) != sizes[k]:
            # A quarter turn otherwise than the workers read the header (TorchCodec reads
            # EXIF itself), or another size: the crop was drawn for the workers' image, so
            # the host path makes this one, as the workers would have.
            refused.append(k)
            continue
        if image is not None:
            kept.append(k)
    # (bicubic or bilinear, antialiased: one resize for the batch, not one a crop)
    resized = resized_crops([decoded[k] for k in kept], batch.boxes[kept], size,
                            batch.bicubic[kept], device)
    if len(kept) == len(decoded):
        crops = resized
    else:  # the refused ones are made on the host (hand_over)
        crops = torch.zeros(len(decoded), 3, size, size, dtype=torch.uint8, device=device)
        crops[on_device(torch.tensor(kept, dtype=torch.int64), device)] = resized
    return flipped(crops, batch.mirrored, batch.upside_down, batched=device.type != "cpu"), \
        sorted(refused)


def flipped(crops: torch.Tensor, mirrored: torch.Tensor, upside_down: torch.Tensor,
            batched: bool) -> torch.Tensor:
    """uint8 [J, 3, S, S] `crops`, each flipped left-right where the host bool tensor
    `mirrored` says and top-bottom where `upside_down` says.

    `batched` (on a GPU): a select over the whole flipped batch, no operator a crop and no
    synchronization (the masks are host tensors).  Else (on a CPU, a loader worker's
    --host-decode-share) one flip a flipped crop, stacked: there the select reads and writes
    whole batches, 4-9 ms a batch of 32 at 224 px against 0.4 (AMD EPYC, one thread), a tenth
    of the share's time an image."""
    if not (mirrored.any() or upside_down.any()):
        return crops
    if not batched:
        return torch.stack([
            crop.flip([dim for dim, flip in ((-2, down), (-1, mirror)) if flip])
            if mirror or down else crop
            for crop, mirror, down in zip(crops, mirrored.tolist(), upside_down.tolist())])
    for mask, dim in ((mirrored, -1), (upside_down, -2)):
        if mask.any():
            crops = torch.where(on_device(mask, crops.device).view(-1, 1, 1, 1), crops.flip(dim),
                                crops)
    return crops


def decode_jpegs(blobs: list[torch.Tensor], orientations: list[int], device: torch.device) -> \
        tuple[list[Optional[torch.Tensor]], list[int]]:
    """The batch in one call, each image turned as its EXIF orientation says (read by the
    workers: `jpeg_header`); when the decoder refuses the batch, each file alone, to find
    which."""
    decoder = jpeg_decoder()  # (unfit_reason refused the device path without one)

    def decode(data: list[torch.Tensor], turns: list[int]) -> list[torch.Tensor]:
        if device.type == "cuda":
            # nvJPEG's hardware decoder (A100, H100, H200) writes its outputs before the
            # work already queued on its stream has run, and the caching allocator may hand
            # it blocks that queued kernels still read: with the training step's stream,
            # the last step's tensors were overwritten (NaN in the weights within five
            # steps on an H200).  Draining its stream first is the known cure (torchcodec's
            # decoder does it; torchvision's does not yet): here the side stream
            # (`DeviceDecoder.start`), which holds only the last batch's crops.
            torch.cuda.current_stream(device).synchronize()
        return decoder.decode(data, device, turns)

    decoded = each_or_none(decode, blobs, orientations)
    return decoded, [k for k, image in enumerate(decoded) if image is None]


def _blend(images: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's tensor `_blend` on uint8 images held as float32 integers, with a ratio per
    image: computed in float32, clamped, truncated to a whole level (its `.to(uint8)`)."""
    ratio64 = ratio.view(-1, 1, 1, 1)
    mixed = ratio64.float() * images + (1.0 - ratio64).float() * other
    return mixed.clamp_(0, 255).floor_()


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """torchvision's rgb_to_grayscale on uint8 (here held as float32 integers): float32
    weights, truncated to a whole level."""
    r, g, b = images.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).floor_().unsqueeze(1)


def jitter(images: torch.Tensor, order: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """ColorJitter (brightness, contrast, saturation; no hue) on a uint8 batch, each image with
    its own order and factors (on the images' device): torchvision's tensor arithmetic batched
    (per image it equals `F.adjust_*` in that order; the tests check it against them).

    Each of the three parts blends the image with something else (black, its grey mean, its
    grey image) by its factor, so one blend a place does all three, each image with its own
    `other`; and the pixels stay float32 from part to part, each part truncated to whole
    levels as torchvision's uint8 results are.  Why: a blend of the whole batch for every
    part, and a conversion to uint8 and back after each, made the jitter most of the device
    path's GPU time (about 13 of 18 ms a batch of 256 at 224 px on an H200)."""
    # Hue (3) is off: each image's place for it is dropped and its three other parts kept in
    # their order (sorted by a key that puts the 3 last and keeps the others' places, with no
    # device-to-host read), so that three places do the work, not four with a quarter of
    # their images passed through unchanged (AMD EPYC, one thread, 64 images at 224 px: 324 ms
    # against 446, the same pixels).
    places = torch.arange(order.shape[1], device=order.device)
    hue_last = ((order == 3) * order.shape[1] + places).argsort(dim=1)
    order = order.gather(1, hue_last)[:, :3]
    pixels = images.float()
    for place in range(order.shape[1]):
        part = order[:, place].view(-1, 1, 1, 1)  # 0 brightness, 1 contrast, 2 saturation
        gray = _grayscale(pixels)
        mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
        other = torch.where(part == 0, 0.0, torch.where(part == 1, mean, gray))
        pixels = _blend(pixels, other, factors.gather(1, order[:, place].view(-1, 1)))
    return pixels.to(torch.uint8)


# -- choosing -----------------------------------------------------------------------------------
def unfit_reason(source: ImageSource, transform: ImageTransform, streaming: bool) -> \
        Optional[str]:
    """Why this data cannot be decoded on the device, whatever the device; None if it can."""
    if streaming:
        return "the training data is streamed from shards"
    if isinstance(source, ArraySource):
        return ("the training images are decoded once, into memory (--in-memory always; "
                "--in-memory never leaves them files)")
    if not isinstance(source, HFSource):
        return "the training images are not files"
    unfit = transform_unfit(transform)
    if unfit:
        return unfit
    if jpeg_decoder() is None:  # (last: data the device cannot take is the first thing to say)
        return missing()
    return None


def transform_unfit(transform: ImageTransform) -> Optional[str]:
    """Why the device cannot make this training transform's crops (timm's crop, flips and
    colour jitter, `draw_plans`), None if it can (held photographs too: held_photos.py)."""
    if not transform.augment:
        return "the training images are not augmented"
    if transform.policy is not None:
        return "--auto-augment's policy works on the host, one image at a time"
    if transform.train_interpolation not in ("random", *DEVICE_INTERPOLATIONS):
        return (f"--train-interpolation {transform.train_interpolation} is PIL's only; use "
                f"random, bilinear or bicubic")
    return None


class Decoding(NamedTuple):
    """Where a run's training JPEGs are decoded: on the device or by the loader workers, why
    (for the summary; empty when auto had nothing to choose), and the share of each batch's
    JPEGs the workers decode all the same when the device takes the rest (--host-decode-
    share, or the one auto chose)."""

    on_device: bool
    why: str
    share: float = 0.0


def loop_rate(share: float, rates: dict) -> float:
    """Images a second the loop can train at when the loader workers decode, crop and resize
    `share` of each batch's JPEGs and the device the rest (`rates` as `time_paths` gives them,
    img/s): the workers bound it at shared / share, and the GPU, which decodes (1 - share) of
    the images, jitters the workers' crops and trains them all in turn, at 1 / (1/train +
    (1 - share)/device + share/jitter)."""
    workers = rates["shared"] / share if share > 0 else math.inf
    return min(workers, 1 / (1 / rates["train"] + (1 - share) / rates["device"]
                             + share / rates["jitter"]))


def best_share(rates: dict) -> float:
    """The share at which `loop_rate`'s two bounds meet (share/shared = 1/train + (1 - share)/
    device + share/jitter), in hundredths, at most 1; 0 where a crop of the workers' would cost
    the GPU more than decoding its JPEG there (then nothing is gained by sharing)."""
    gained = 1 / rates["shared"] + 1 / rates["device"] - 1 / rates["jitter"]
    if gained <= 0:
        return 0.0
    return min(1.0, round((1 / rates["train"] + 1 / rates["device"]) / gained, 2))


def choose(mode: str, source: ImageSource, transform: ImageTransform, cuda: bool,
           streaming: bool, rates: Optional[Callable[[], dict]] = None,
           share: Optional[float] = None) -> Decoding:
    """Where the training JPEGs are decoded (`Decoding`).  `share`: --host-decode-share, None
    where it was not given (auto then chooses one; always and never take 0).  `rates()`
    measures, for auto on a GPU (`time_paths`), img/s: "host", the loader's workers' whole
    path; "shared", their share's (decoded, cropped, resized, flipped); "device", the GPU
    decoding and cropping; "jitter", the GPU taking the workers' crops; "train", training.

    auto takes the workers alone where their whole path keeps up with training; else it weighs
    them, min(train, host), against the device path with the share `best_share` gives (or the
    one given), at `loop_rate`, and takes the device only where it promises MIN_GAIN more.
    The device's rates are timed synchronously, their host work included, which overstates
    their GPU time: the share chosen then leans to the workers, and the loop runs at what
    they can feed it, which `loop_rate` predicts."""
    flag = f"--decode-on-device {mode}"
    if mode == "never":
        return Decoding(False, f"by the loader workers ({flag})")
    unfit = unfit_reason(source, transform, streaming)
    if unfit and mode == "always":
        raise UsageError(f"{flag}: {unfit}; use --decode-on-device auto or never")
    if mode == "always":
        return Decoding(True, f"on the device ({flag})", share or 0.0)
    # Nothing to say where auto had nothing to weigh (the summary names only a real choice).
    if unfit or not cuda or source.native_size <= SMALL_IMAGE:
        return Decoding(False, "")
    measured = rates()
    host, train = measured["host"], measured["train"]
    if host >= train:
        return Decoding(False, f"by the loader workers ({flag}: they decode {host:,.0f} img/s, "
                               f"at least what training at {train:,.0f} img/s takes)")
    chosen = best_share(measured) if share is None else share
    with_device = loop_rate(chosen, measured)
    with_host = min(train, host)
    split = f" with {chosen:.0%} of each batch's JPEGs left to the workers" if chosen else ""
    figures = (f"the workers decode {host:,.0f} img/s, or crop {measured['shared']:,.0f} for "
               f"the device to jitter ({measured['jitter']:,.0f} img/s), which decodes "
               f"{measured['device']:,.0f} img/s beside training at {train:,.0f} img/s: "
               f"{with_device:,.0f}{split} against {with_host:,.0f} img/s")
    if with_device >= MIN_GAIN * with_host:
        return Decoding(True, f"on the device ({flag}: {figures})", chosen)
    return Decoding(False, f"by the loader workers ({flag}: {figures})")


def sharing_all(images):
    """`images` (loaders.TrainImages) whose batches the workers hand the device as its
    --host-decode-share of all their JPEGs (decoded, cropped, resized, flipped: `encode_batch`):
    what a worker spends on an image of the share, and what the device then does with it, for
    --decode-on-device auto to time."""
    view = copy.copy(images)
    view.decodes_on_device, view.host_decode_share = True, 1.0
    return view


def time_paths(dataset, host_rate: Callable[[], float], shared_rate: Callable[[], float],
               device: torch.device, train_rate: Callable[[], float]) -> dict:
    """The rates `choose` weighs: `host_rate()` and `shared_rate()` (the loader's workers, timed
    together: loading.machine_workers_rate, on their whole path and on the share's), the device
    path decoding and cropping PROBE_IMAGES of the run's own training images (spread over
    the set), and taking the workers' crops of them (made here first, untimed), and
    `train_rate()`."""
    count = min(PROBE_IMAGES, len(dataset))
    keys = spread(count, len(dataset))
    decoder = DeviceDecoder(device, dataset)
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(encoded) -> float:
        seconds = math.inf
        for _ in range(2):  # the first pays its start-up (libraries, kernels)
            wait()
            started = time.perf_counter()
            decoder(encoded.images, encoded.labels, torch.full_like(encoded.labels, -1))
            wait()
            seconds = min(seconds, time.perf_counter() - started)
        return count / seconds

    return {"host": host_rate(), "shared": shared_rate(),
            "device": timed(dataset.encoded_batch(keys)),
            "jitter": timed(sharing_all(dataset).encoded_batch(keys)), "train": train_rate()}
