"""Augmentation policies (RandAugment, TrivialAugmentWide, AutoAugment, AugMix) and random
erasing, from timm and torchvision, made functions of (seed, epoch, index).

Both libraries draw from global random states (Python's `random`, numpy's, torch's).  Every image
here draws inside `randomness.seeded(...)`, which seeds all three from the sample's key and puts
the outside states back after: an image is augmented the same way whichever worker, process or
resumed run loads it (transforms.py's rule), and nothing else in the process is disturbed.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from accel_train.base.errors import UsageError
from accel_train.base.randomness import each_seeded

# torchvision's policies by name; the timm-style strings ("rand-m9-mstd0.5-inc1", "augmix-m5",
# "original", "v0", ...) go to timm's factories.
TORCHVISION_POLICIES = {
    "randaugment": lambda: T.RandAugment(),
    "trivialaugment": lambda: T.TrivialAugmentWide(),
    "trivialaugmentwide": lambda: T.TrivialAugmentWide(),
    "autoaugment": lambda: T.AutoAugment(T.AutoAugmentPolicy.IMAGENET),
    "autoaugment-imagenet": lambda: T.AutoAugment(T.AutoAugmentPolicy.IMAGENET),
    "autoaugment-cifar10": lambda: T.AutoAugment(T.AutoAugmentPolicy.CIFAR10),
    "autoaugment-svhn": lambda: T.AutoAugment(T.AutoAugmentPolicy.SVHN),
    "augmix": lambda: T.AugMix(),
}
TIMM_PREFIXES = ("rand", "augmix", "original", "originalr", "v0", "v0r", "3a")
ERASING_SALT = 0x5EED_E4A5  # keeps erasing's draws apart from the policy's for the same image
ERASING_CANVAS_ELEMENTS = 1 << 22  # floats of `erasing_plan`'s canvas (16 MB)
INT32_POSITIONS = torch.iinfo(torch.int32).max  # a batch's positions as int32 up to this many


def build_policy(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [3, H, W] -> uint8 [3, H, W] for a policy name; a UsageError naming the flag for
    an unknown one."""
    key = name.strip().lower()
    if key in TORCHVISION_POLICIES:
        return TORCHVISION_POLICIES[key]()
    if key.split("-")[0] in TIMM_PREFIXES:
        return _timm_policy(name.strip())
    raise UsageError(f"--auto-augment {name!r} is not a policy we know; use one of "
                     f"{', '.join(sorted(TORCHVISION_POLICIES))} (torchvision) or a timm string "
                     f"such as rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, original")


def _timm_policy(config_str: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from timm.data.auto_augment import (augment_and_mix_transform, auto_augment_transform,
                                        rand_augment_transform)

    # magnitude_max just under timm's 10: at 10 its "increasing" posterize asks for 0 bits,
    # which current Pillow refuses ("bits must be between or equal to 1 and 8").
    hparams = {"translate_const": 100, "img_mean": (124, 116, 104), "magnitude_max": 9.99}
    try:
        if config_str.startswith("rand"):
            policy = rand_augment_transform(config_str, hparams)
        elif config_str.startswith("augmix"):
            policy = augment_and_mix_transform(config_str, hparams)
        else:
            policy = auto_augment_transform(config_str, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as err:
        raise UsageError(f"--auto-augment {config_str!r}: timm cannot read it ({err}); e.g. "
                         f"rand-m9-mstd0.5-inc1") from None

    return OnPILImage(policy)


class OnPILImage:
    """A transform of PIL images (timm's policies) applied to a uint8 CHW tensor.  A class, not a
    closure: loader workers receive it pickled (worker_start.py)."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return TF.pil_to_tensor(self.transform(TF.to_pil_image(image)))


def build_erasing(probability: float):
    """timm's RandomErasing (per-pixel normal noise, as in timm's recipes) on one normalized
    float image; None when off."""
    if probability <= 0:
        return None
    from timm.data.random_erasing import RandomErasing
    return RandomErasing(probability=probability, mode="pixel", device="cpu")


def apply_seeded(function, images: torch.Tensor, seed: int, epochs, indices,
                 salt: int = 0) -> torch.Tensor:
    """`function` on each image of a batch, each inside its own seeded(seed, epoch, index)."""
    return torch.stack(each_seeded(function, images, _sample_keys(seed, epochs, indices, salt)))


def erasing_plan(erasing, shape: torch.Size, seed: int, epochs, indices,
                 salt: int = ERASING_SALT) -> tuple[torch.Tensor, torch.Tensor]:
    """What timm's RandomErasing writes into a float batch of `shape`, each image inside its own
    seeded(seed, epoch, index, salt): (where, values), the flat positions it writes and their
    values.  timm reads only an image's shape, so its draws into a host canvas of NaN are the
    patches it would write into the image, and where the canvas is no longer NaN is where they
    go.  Why a plan rather than timm on the images: drawn on the host (in a loader worker, with
    the pixels), it is applied on the images' device in one operation (`apply_erasing`); timm's
    own per-image writes into a GPU's images were each a copy from pageable host memory that
    waited for all the GPU work queued before it (BENCHMARKS.md, "GPU: one NVIDIA H200")."""
    keys = _sample_keys(seed, epochs, indices, salt)
    per_image = math.prod(shape[1:])
    # A canvas of a few images at a time, not of the whole batch: a loader worker's memory
    # then stays bounded whatever the image size (a batch of 224 px images is 150 MB as floats).
    chunk = max(1, ERASING_CANVAS_ELEMENTS // per_image)
    canvas = torch.empty(min(chunk, shape[0]), *shape[1:])
    wheres, values = [], []
    for start in range(0, shape[0], chunk):
        part = canvas[:min(chunk, shape[0] - start)].fill_(float("nan"))
        each_seeded(erasing, part, keys[start:start + len(part)])  # in place
        flat = part.view(-1)
        where = (~torch.isnan(flat)).nonzero().squeeze(1)
        wheres.append(where + start * per_image)
        values.append(flat[where])
    where = torch.cat(wheres)
    if shape[0] * per_image <= INT32_POSITIONS:  # half the bytes for the loader to hand over
        where = where.to(torch.int32)
    return where, torch.cat(values)


def apply_erasing(images: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A float batch with `erasing_plan`'s values written at its positions (a new tensor)."""
    where, values = plan
    if where.numel() == 0:
        return images
    flat = images.reshape(-1).clone()
    flat.index_copy_(0, where.to(images.device).long(), values.to(images.device, images.dtype))
    return flat.view_as(images)


def _sample_keys(seed: int, epochs, indices, salt: int) -> list[tuple[int, int, int, int]]:
    return [(seed, int(epoch), int(index), salt) for epoch, index in zip(epochs, indices)]
