"""Per-image transforms on uint8 CHW tensors.

Random augmentation draws from a generator seeded by (seed, epoch, sample index), never from the
global RNG: an image gets the same crop whichever process, worker or resumed run loads it, which
is what makes a mid-epoch resume and a change of world size reproduce the uninterrupted run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

SMALL_IMAGE = 64  # at or below: pad-and-crop (CIFAR style); above: random resized crop


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # Distinct large odd multipliers keep (seed, epoch, index) triples from colliding.
    key = (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + index * 0xC2B2AE3D) % (2**63 - 1)
    return torch.Generator().manual_seed(key)


def _uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def _randint(generator: torch.Generator, high_inclusive: int) -> int:
    return int(torch.randint(0, high_inclusive + 1, (), generator=generator))


@dataclass(frozen=True)
class ImageTransform:
    """Resize to `image_size`, optionally augment, scale to [0, 1] and normalize."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool = False

    def __call__(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        size = self.image_size
        if self.augment:
            if generator is None:
                raise ValueError("augmenting needs a seeded generator")
            if max(image.shape[-2:]) <= SMALL_IMAGE:
                image = self._pad_crop(self._resize(image), generator)
            else:
                image = self._resized_crop(image, generator)
            if float(torch.rand((), generator=generator)) < 0.5:
                image = image.flip(-1)
        else:
            image = self._resize(image)
        out = image.float().div_(255)
        mean = torch.tensor(self.mean).view(3, 1, 1)
        std = torch.tensor(self.std).view(3, 1, 1)
        return out.sub_(mean).div_(std)

    def _resize(self, image: torch.Tensor) -> torch.Tensor:
        if tuple(image.shape[-2:]) == (self.image_size, self.image_size):
            return image
        return TF.resize(image, [self.image_size, self.image_size], antialias=True)

    def _pad_crop(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        pad = max(1, self.image_size // 8)
        padded = F.pad(image.unsqueeze(0).float(), (pad, pad, pad, pad), mode="reflect")
        top, left = _randint(generator, 2 * pad), _randint(generator, 2 * pad)
        crop = padded[0, :, top:top + self.image_size, left:left + self.image_size]
        return crop.to(torch.uint8)

    def _resized_crop(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        height, width = image.shape[-2:]
        area = height * width
        for _ in range(10):
            target = area * _uniform(generator, 0.25, 1.0)
            ratio = math.exp(_uniform(generator, math.log(3 / 4), math.log(4 / 3)))
            w = round(math.sqrt(target * ratio))
            h = round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                top, left = _randint(generator, height - h), _randint(generator, width - w)
                break
        else:  # fall back to the central square
            h = w = min(height, width)
            top, left = (height - h) // 2, (width - w) // 2
        return TF.resized_crop(image, top, left, h, w, [self.image_size, self.image_size],
                               antialias=True)
