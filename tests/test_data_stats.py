"""dataset_mean_std against numpy on non-constant images, for in-memory and per-image sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel_train.data.loaders import dataset_mean_std
from accel_train.data.sources import ArraySource, ImageSource

# The product rounds to 4 decimals: at most 5e-5 off, plus float32 summation noise.
TOL = 6e-5


class ListSource(ImageSource):
    """Images decoded one by one (the path for data that is not held in memory)."""

    def __init__(self, images: list[torch.Tensor]):
        self._images = images
        self.labels = torch.zeros(len(images), dtype=torch.long)

    def image(self, index: int) -> torch.Tensor:
        return self._images[index]


def _channels_differ(rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
    """uint8 [n, 3, h, w]: each channel with its own distribution (catches a mixed-up axis)."""
    red = rng.integers(0, 256, (n, h, w))                     # uniform: mean ~127.5, std ~74
    green = rng.normal(60, 10, (n, h, w)).clip(0, 255)         # dark, narrow
    blue = (rng.random((n, h, w)) < 0.3) * 250                 # two values: mean 75, std ~115
    return np.stack([red, green, blue], axis=1).astype(np.uint8)


@pytest.mark.parametrize("n", [40, 600])  # 600: more than one chunk of images at a time
def test_in_memory_mean_std_equal_numpy(n):
    pixels = _channels_differ(np.random.default_rng(11), n, 32, 32)
    mean, std = dataset_mean_std(ArraySource(torch.from_numpy(pixels), torch.zeros(n).long()))
    scaled = pixels.astype(np.float64) / 255
    np_mean = scaled.mean(axis=(0, 2, 3))
    np_std = scaled.std(axis=(0, 2, 3))  # 40960 pixels a channel: ddof 0 or 1 differ by < 1e-5
    assert mean == pytest.approx(tuple(np_mean), abs=TOL)
    assert std == pytest.approx(tuple(np_std), abs=TOL)
    assert len(set(np.round(np_mean, 2))) == 3 and len(set(np.round(np_std, 2))) == 3


def test_mixed_size_images_weight_every_pixel_equally():
    rng = np.random.default_rng(12)
    sizes = [(10, 14), (30, 8), (5, 5), (20, 20), (12, 40)]
    images = [_channels_differ(rng, 1, h, w)[0] for h, w in sizes]
    mean, std = dataset_mean_std(ListSource([torch.from_numpy(i) for i in images]))
    all_pixels = np.concatenate([i.reshape(3, -1) for i in images], axis=1) / 255  # [3, P]
    assert mean == pytest.approx(tuple(all_pixels.mean(axis=1)), abs=TOL)
    assert std == pytest.approx(tuple(all_pixels.std(axis=1)), abs=TOL)
    # the per-image average of means is a different number here: the oracle can tell them apart
    per_image = np.mean([i.reshape(3, -1).mean(axis=1) / 255 for i in images], axis=0)
    assert np.abs(per_image - all_pixels.mean(axis=1)).max() > 10 * TOL


def test_both_paths_agree_on_the_same_images():
    pixels = _channels_differ(np.random.default_rng(13), 30, 24, 24)
    tensors = torch.from_numpy(pixels)
    in_memory = dataset_mean_std(ArraySource(tensors, torch.zeros(30).long()))
    one_by_one = dataset_mean_std(ListSource(list(tensors)))
    assert in_memory[0] == pytest.approx(one_by_one[0], abs=2 * TOL)
    assert in_memory[1] == pytest.approx(one_by_one[1], abs=2 * TOL)
