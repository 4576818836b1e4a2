"""Image transforms on uint8 CHW tensors, one image at a time or a whole batch at once.

Random augmentation is a function of (seed, epoch, sample index) only, never of the global RNG:
an image gets the same crop whichever process, worker or resumed run loads it, which is what
makes a mid-epoch resume and a change of world size reproduce the uninterrupted run.

Small images (CIFAR-sized, the in-memory case) take the batched path: the crop offsets and flips
of a whole batch come from one vectorized hash of (seed, epoch, index) (`augment_bits`), and the
reflect-pad, crop, flip and normalization are a handful of tensor operations per batch instead of
a dozen per image.  A single image goes through the very same code as a batch of one, so the two
paths give identical tensors.

Larger images go through timm's own transforms, one image at a time, as PIL images: in training
`timm.data.create_transform(is_training=True, ...)` (random resized crop, flips, colour jitter;
its policy and random erasing are ours, below), each image's draws made inside
`randomness.seeded(seed, epoch, index, CROP_SALT)` (timm draws from Python's `random` and torch's
global generator); held out, timm's eval transform at the run's crop_pct, crop_mode and
interpolation, so that an export's config.json tells timm exactly what training evaluated.  Both
stop at uint8 pixels (timm's prefetcher form, `use_prefetcher=True`): normalizing is `finish`'s,
on the device, as for small images.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from accel_train.base.errors import UsageError
from accel_train.base.randomness import each_seeded
from accel_train.data.augment import apply_erasing, apply_seeded, erasing_plan
from accel_train.data.centre_crop import long_thin_centre_crop

SMALL_IMAGE = 64  # at or below: pad-and-crop (CIFAR style); above: timm's transforms
CROP_SALT = 0xC809  # keeps the crop's draws apart from the policy's (salt 0) for the same image
# How many of each sample's 64 hash bits decide its mirroring on the small path (bits 49-63;
# the crop offsets take bits 1-48): mirrored when they are at least (1 - hflip) of 2**15, which
# at hflip 0.5 is the top bit alone.
FLIP_BITS = 15

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 step on uint64 arrays (wrapping arithmetic, logical shifts)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def augment_bits(seed: int, epochs, indices) -> np.ndarray:
    """64 well-mixed random bits per sample, a pure function of (seed, epoch, index)."""
    epochs = np.asarray(epochs, dtype=np.int64).astype(np.uint64)
    indices = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = _splitmix64(np.full_like(indices, seed & _MASK64, dtype=np.uint64))
        x = _splitmix64(x ^ epochs)
        return _splitmix64(x ^ indices)


@contextlib.contextmanager
def one_thread():
    """Run a transform on one intra-op thread.  Its tensors are small (a batch of CIFAR images is
    a few hundred kB): splitting each op across cores costs more in synchronization than it
    saves, and when the cores are busy (training in other processes, a shared machine) the
    OpenMP barrier waits made the batched CIFAR augmentation 10x slower on two threads than on
    one.  The training step itself keeps all threads: only the input pipeline is confined.
    (A block, not a decorator, in the methods below: mutmut leaves decorated functions alone.)"""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def single_threaded(method):
    """`one_thread()` around a whole method (the datasets' batched reads)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with one_thread():
            return method(*args, **kwargs)
    return wrapper


@functools.lru_cache(maxsize=None)
def _channel_stats(mean: tuple, std: tuple,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """255 (a 0-dim tensor), mean and std ([1, 3, 1, 1]) as float tensors on `device`, made once
    per device: made at every step they would be a blocking host-to-device copy, which on a GPU
    waits for all the work queued before it (a synchronization per micro-batch).

    Why 255 as a tensor on the device, not a Python number: CUDA divides a tensor by a number
    as a product with the number's float32 reciprocal (aten's div_true_kernel_cuda: "may lose
    one bit of precision"), one bit off x / 255 for about half the 256 levels; by a tensor on
    the device it divides as the CPU does, so that uint8 pixels normalized on a GPU are the
    loader workers' floats to the bit."""
    return (torch.tensor(255.0, device=device),
            torch.tensor(mean, device=device).view(1, 3, 1, 1),
            torch.tensor(std, device=device).view(1, 3, 1, 1))


@dataclass(frozen=True)
class ImageTransform:
    """Resize to `image_size`, optionally augment, scale to [0, 1] and normalize."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool = False
    # --flip: "random" mirrors each image with probability 1/2 in every epoch, independently;
    # "alternate" mirrors each image in every other epoch (airbench, arXiv:2404.00498: a random
    # half of the images in even epochs, the other half in odd ones), so that every image is
    # seen both ways in any two consecutive epochs instead of at random.
    flip: str = "random"
    # --crop-pad: how far the CIFAR-style crop may shift an image (None: the size / 8)
    crop_pad: Optional[int] = None
    # With augment, after the crop and flip (augment.py: seeded per sample like the crop):
    policy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # --auto-augment, uint8
    erasing: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # --reprob, normalized
    # --hflip: the probability of mirroring under flip "random", on both paths.
    hflip: float = 0.5
    # Training above SMALL_IMAGE (timm's create_transform arguments; config.py's flags): the
    # random resized crop's area fraction and aspect ratio ranges, the vertical flip, colour
    # jitter (0: off) and the resize's interpolation ("random": bilinear or bicubic per image).
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    vflip: float = 0.0
    color_jitter: float = 0.0
    train_interpolation: str = "bilinear"
    # Held out (timm's pretrained_cfg terms, what the run's ModelSpec records): squash with
    # crop_pct 1 and bilinear is the plain resize of both sides that small images always had.
    crop_pct: float = 1.0
    crop_mode: str = "squash"
    interpolation: str = "bilinear"

    def __post_init__(self):
        # reflect padding needs less than the image's own size
        if self.augment and self.crop_pad is not None and self.crop_pad >= self.image_size:
            raise UsageError(f"--crop-pad {self.crop_pad} must be below the image size "
                             f"({self.image_size} px)")

    def __call__(self, image: torch.Tensor,
                 sample: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
        """One uint8 [3, H, W] image -> float [3, S, S]; `sample` = (seed, epoch, index) is
        required when augmenting (it decides the crop and the flip)."""
        seed, epoch, index = sample if sample is not None else (0, 0, 0)
        with one_thread():
            return self.finish(self.pixels(image, sample).unsqueeze(0), seed, [epoch],
                               [index])[0]

    def batch(self, images: torch.Tensor, seed: int = 0, epochs: Sequence[int] = (),
              indices: Sequence[int] = ()) -> torch.Tensor:
        """A uint8 [B, 3, H, W] batch of same-sized images -> float [B, 3, S, S].  When
        augmenting, epochs[i] and indices[i] name sample i (its crop and flip depend on them).
        Always `finish(pixel_batch(...))`: the training loaders run the two halves apart (the
        first in the loader, the second on the device), and give the same tensors."""
        with one_thread():
            return self.finish(self.pixel_batch(images, seed, epochs, indices), seed, epochs,
                               indices)

    # -- the two halves: pixels on the host, then the float work on the device ----------------
    @property
    def erases(self) -> bool:
        """Whether `finish` erases (--reprob, when augmenting): then it needs each sample's
        (epoch, index)."""
        return self.augment and self.erasing is not None

    def pixels(self, image: torch.Tensor,
               sample: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
        """One uint8 image -> its uint8 [3, S, S] pixels after resize, crop, flip and policy."""
        if self.augment and sample is None:
            raise ValueError("augmenting needs the sample's (seed, epoch, index)")
        seed, epoch, index = sample if sample is not None else (0, 0, 0)
        return self.pixel_batch(image.unsqueeze(0), seed, [epoch], [index])[0]

    def pixel_batch(self, images: torch.Tensor, seed: int = 0, epochs: Sequence[int] = (),
                    indices: Sequence[int] = ()) -> torch.Tensor:
        """uint8 [B, 3, H, W] -> uint8 [B, 3, S, S]: resized, and when augmenting cropped,
        flipped and put through --auto-augment's policy.  What a loader hands to the device:
        a quarter of float32's bytes."""
        with one_thread():
            return self._pixel_batch(images, seed, epochs, indices)

    def pixel_list(self, images: Sequence[torch.Tensor], seed: int, epochs: Sequence[int],
                   indices: Sequence[int]) -> torch.Tensor:
        """uint8 [3, H, W] images of any sizes (a batch decoded per step) -> uint8 [B, 3, S, S],
        each image's pixels as `pixels` makes them alone.  Photos of many sizes go through
        timm's transform in one pass: per image, the thread setting, the generators' states
        saved and put back and a stack of one took 0.2 ms of the loader workers' 3.3 ms an
        ImageNet-sized JPEG (AMD EPYC, bench_jpeg_input.py's profile)."""
        if len({image.shape for image in images}) == 1:
            return self.pixel_batch(torch.stack(list(images)), seed, epochs, indices)
        if min(max(image.shape[-2:]) for image in images) > SMALL_IMAGE:
            with one_thread():
                return self._pixel_batch(images, seed, epochs, indices)
        # small images among larger ones: each its own path (the small path is batched)
        return torch.stack([self.pixels(image, (seed, int(epoch), int(index)))
                            for image, epoch, index in zip(images, epochs, indices)])

    def _pixel_batch(self, images: torch.Tensor | Sequence[torch.Tensor], seed: int,
                     epochs: Sequence[int], indices: Sequence[int]) -> torch.Tensor:
        """`images`: a uint8 [B, 3, H, W] batch, or a list of images all above SMALL_IMAGE."""
        large = not isinstance(images, torch.Tensor) or max(images.shape[-2:]) > SMALL_IMAGE
        if self.augment and large:
            images = self._augment_large(images, seed, epochs, indices)
        elif not self.augment and (large or not self.plain_resize):
            return torch.stack([self._held_out(TF.to_pil_image(image)) for image in images])
        else:
            images = self.place(images, self.crop_plan(seed, epochs, indices))
            if not self.augment:
                return images
        if self.policy is not None:
            images = apply_seeded(self.policy, images, seed, epochs, indices)
        return images

    # -- the small-image geometry on its own: where it runs is the loader's choice -------------
    @property
    def plain_resize(self) -> bool:
        """Whether the held-out preparation is the plain resize of both sides (squash, crop_pct
        1, bilinear), which small images take on the batched tensor path; any other is timm's
        eval transform, whatever the size."""
        return self.crop_mode == "squash" and self.crop_pct == 1.0 and \
            self.interpolation == "bilinear"

    def can_place(self, images_shape: Sequence[int]) -> bool:
        """Whether a batch of this (stored) shape may leave the loader at its stored size, its
        resize, crop and flip done by `place` on the device: the small-image (CIFAR-style)
        path, without --auto-augment (whose policy works on the placed uint8 pixels), and
        without augmenting only when the held-out preparation is the plain resize."""
        return max(images_shape[-2:]) <= SMALL_IMAGE and self.policy is None and \
            (self.augment or self.plain_resize)

    def crop_plan(self, seed: int, epochs: Sequence[int],
                  indices: Sequence[int]) -> Optional[torch.Tensor]:
        """Each small image's crop offsets and flip, int64 [B, 3] (top, left, mirrored), a
        function of (seed, epoch, index); None when not augmenting (a plain resize)."""
        if not self.augment:
            return None
        bits = augment_bits(seed, epochs, indices)
        flips = self._flips(bits, seed, epochs, indices)
        bits = torch.from_numpy((bits >> np.uint64(1)).astype(np.int64))  # 63 bits, >= 0
        span = 2 * self._pad() + 1  # possible offsets per axis
        top = ((bits & 0xFFFFFF) * span) >> 24
        left = (((bits >> 24) & 0xFFFFFF) * span) >> 24
        return torch.stack([top, left, flips.long()], dim=1)

    def place(self, images: torch.Tensor, plan: Optional[torch.Tensor]) -> torch.Tensor:
        """uint8 [B, 3, H, W] small images, on any device -> uint8 [B, 3, S, S] on it: resized,
        then (with a `crop_plan`, on the same device) reflect-padded, cropped and flipped."""
        images = self._resize(images)
        if plan is None:
            return images
        return self._pad_crop_flip(images, plan)

    def finish(self, images: torch.Tensor, seed: int = 0, epochs: Sequence[int] = (),
               indices: Sequence[int] = (),
               erasing: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """uint8 [B, 3, S, S] pixels, on any device -> float, normalized, then (when
        augmenting with --reprob) randomly erased, on the same device.  Erasing needs each
        sample's (epoch, index), or their `erasing_plan` drawn beforehand (a loader worker
        draws it with the pixels); normalizing alone does not."""
        with one_thread():  # on a CPU; a no-op for a GPU's tensors
            images = self._normalize(images)
            if self.erases:
                if erasing is None:
                    erasing = self.erasing_plan(images.shape, seed, epochs, indices)
                images = apply_erasing(images, erasing)
            return images

    def erasing_plan(self, shape: torch.Size, seed: int, epochs: Sequence[int],
                     indices: Sequence[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """What `finish` erases in a batch of `shape` (augment.erasing_plan), drawn on the host;
        None when it does not erase."""
        if not self.erases:
            return None
        with one_thread():
            return erasing_plan(self.erasing, shape, seed, epochs, indices)

    # -- pieces ---------------------------------------------------------------------------------
    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 3, S, S] on any device -> float, on that device."""
        scale, mean, std = _channel_stats(self.mean, self.std, images.device)
        out = images.float().div_(scale)  # a copy: the uint8 source is never written
        return out.sub_(mean).div_(std)

    def _resize(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[-2:]) == (self.image_size, self.image_size):
            return images
        return TF.resize(images, [self.image_size, self.image_size], antialias=True)

    def _flips(self, bits: np.ndarray, seed: int, epochs, indices) -> torch.Tensor:
        """Which images of a batch are mirrored: those whose top FLIP_BITS bits of `bits` (the
        hash of its (seed, epoch, index) that also places the crop) reach (1 - hflip) of their
        range, the top bit alone at 0.5; under --flip alternate, the top bit of its epoch-0
        hash, inverted in odd epochs."""
        if self.flip == "alternate":
            epochs = np.asarray(epochs, dtype=np.int64)
            bits = augment_bits(seed, np.zeros_like(epochs), indices)
            return torch.from_numpy(((bits >> np.uint64(63)).astype(np.int64) ^ (epochs & 1))
                                    .astype(bool))
        threshold = round((1 - self.hflip) * (1 << FLIP_BITS))
        return torch.from_numpy((bits >> np.uint64(64 - FLIP_BITS)).astype(np.int64) >= threshold)

    def alternate_flips(self, seed: int, epochs, indices) -> torch.Tensor:
        """Which images --flip alternate mirrors (bool [B]): the hash's, as `_augment_large`
        applies them after timm's transform."""
        return self._flips(None, seed, epochs, indices)

    def _pad(self) -> int:
        """How far the CIFAR-style crop may shift: --crop-pad, by default the size / 8."""
        return self.crop_pad if self.crop_pad is not None else max(1, self.image_size // 8)

    def _pad_crop_flip(self, images: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """CIFAR augmentation for a batch: reflect-pad by `_pad()`, take the size x size crop
        at each image's (top, left) of `plan`, mirror the images it marks."""
        size, count, pad = self.image_size, images.shape[0], self._pad()
        top, left, flip = plan.to(images.device).unbind(1)
        padded = F.pad(images, (pad, pad, pad, pad), mode="reflect")    # uint8 [B, 3, P, P]
        ramp = torch.arange(size, device=images.device)
        rows = top[:, None] + ramp                                        # [B, S]
        cols = left[:, None] + torch.where(flip[:, None].bool(), size - 1 - ramp, ramp)
        # One gather over the flattened padded image: faster than advanced indexing or a loop.
        where = rows[:, :, None] * padded.shape[-1] + cols[:, None, :]     # [B, S, S]
        channels = padded.shape[1]
        flat = padded.reshape(count, channels, -1)
        crops = flat.gather(2, where.reshape(count, 1, -1).expand(count, channels, -1))
        return crops.reshape(count, channels, size, size)

    def _augment_large(self, images: torch.Tensor, seed: int, epochs: Sequence[int],
                       indices: Sequence[int]) -> torch.Tensor:
        """timm's training transform on each image, its draws seeded by its (seed, epoch,
        index); --flip alternate mirrors by the hash instead, after it (a mirror commutes with
        colour jitter, which acts on each pixel alike)."""
        keys = [(seed, int(e), int(i), CROP_SALT) for e, i in zip(epochs, indices)]
        out = torch.stack(each_seeded(lambda image: self._timm_train(TF.to_pil_image(image)),
                                      images, keys))
        if self.flip == "alternate":
            mirrored = self.alternate_flips(seed, epochs, indices)
            out = torch.where(mirrored.view(-1, 1, 1, 1), out.flip(-1), out)
        return out

    # timm's transforms, made once per transform (and per loader worker, which receives it
    # pickled): PIL image in, uint8 CHW tensor out.
    @functools.cached_property
    def _timm_train(self):
        from timm.data import create_transform
        return create_transform(
            self.image_size, is_training=True, scale=tuple(self.scale), ratio=tuple(self.ratio),
            hflip=0.0 if self.flip == "alternate" else self.hflip, vflip=self.vflip,
            color_jitter=self.color_jitter or None, interpolation=self.train_interpolation,
            mean=self.mean, std=self.std, use_prefetcher=True)

    def _held_out(self, pil) -> torch.Tensor:
        """timm's eval transform of one PIL image; a very long, thin one's centre crop made from
        the region it keeps (centre_crop.py: the full resize of a 1 x 4000 strip takes 786 MB)."""
        if self.crop_mode == "center":
            from timm.data.transforms import str_to_pil_interp  # as _timm_eval's, imported late
            crop = long_thin_centre_crop(pil, self.image_size, self.crop_pct,
                                         str_to_pil_interp(self.interpolation))
            if crop is not None:
                return TF.pil_to_tensor(crop)  # timm's MaybePILToTensor (use_prefetcher)
        return self._timm_eval(pil)

    @functools.cached_property
    def _timm_eval(self):
        from timm.data import create_transform
        return create_transform(
            self.image_size, is_training=False, crop_pct=self.crop_pct, crop_mode=self.crop_mode,
            interpolation=self.interpolation, mean=self.mean, std=self.std, use_prefetcher=True)


# What a spec that does not say how to crop means (ModelSpec's defaults: the plain resize every
# run used before these fields; also a stand-in spec of size, mean and std alone).
PLAIN_RESIZE = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear"}


def held_out_crop(spec) -> dict:
    """timm's crop_pct, crop_mode and interpolation of a model's spec, as ImageTransform's
    keyword arguments."""
    return {name: getattr(spec, name, plain) for name, plain in PLAIN_RESIZE.items()}


def held_out_transform(spec) -> ImageTransform:
    """How a model's images are prepared for evaluation, `eval`, `predict` and `export`: the
    size, mean, std and timm's crop_pct, crop_mode and interpolation its ModelSpec records."""
    return ImageTransform(spec.image_size, tuple(spec.mean), tuple(spec.std), augment=False,
                          **held_out_crop(spec))
