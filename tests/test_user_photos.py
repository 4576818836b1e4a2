"""Photos a program hands to fit() as PIL images, opened from their files (a Dataset returning
`Image.open(path)`, a Hugging Face dataset's Image column): made into pixels as the command
line makes the same files (EXIF orientation applied, transparency over white, 16-bit and float
gray scaled), so that a model trained by fit() sees what `predict` and `eval` show it.

Oracles: the arrays the files are made from, turned and blended with numpy (imagekinds.py).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import Dataset

import imagekinds as kinds
from accel_train.config import TrainConfig
from accel_train.data.user_data import load_user_data


class OpenedFiles(Dataset):
    """Each file's bytes opened with PIL, as a Dataset over a folder of photos returns them."""

    def __init__(self, files: list[bytes]):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        return Image.open(io.BytesIO(self.files[index])), index % 2


def held(files: list[bytes]) -> list[np.ndarray]:
    data = load_user_data(OpenedFiles(files), OpenedFiles(files), TrainConfig(in_memory="never"))
    return [data.train.image(i).permute(1, 2, 0).numpy() for i in range(len(files))]


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_an_exif_oriented_photo_is_trained_upright(orientation):
    array = kinds.pixels(orientation, 12, 20)
    files = [kinds.exif_oriented_png(array, orientation), kinds.encoded(array, "PNG")]
    turned, plain = held(files)
    assert np.array_equal(turned, kinds.oriented(array, orientation))
    assert np.array_equal(plain, array)


def test_transparency_is_over_white_and_wide_gray_is_scaled():
    data, rgba = kinds.rgba_png()
    alpha = rgba[:, :, 3:].astype(np.float64) / 255
    over_white = rgba[:, :, :3] * alpha + 255 * (1 - alpha)
    values = np.arange(0, 65536, 257, dtype=np.uint16)[:240].reshape(12, 20)
    gray = np.arange(256, dtype=np.uint8).reshape(16, 16)
    blended, sixteen, floats = held([data, kinds.png16_gray(values),
                                     kinds.encoded(gray.astype(np.float32) / 255, "TIFF")])
    assert np.abs(blended - over_white).max() <= 0.5 + 1e-9
    assert np.array_equal(sixteen, np.repeat((values >> 8).astype(np.uint8)[:, :, None], 3, 2))
    assert np.array_equal(floats, np.repeat(gray[:, :, None], 3, 2))


class FileArrays(Dataset):
    """np.asarray of each opened file, as a Dataset over PNGs with transparency often returns
    them: (H, W, 4) uint8 for an RGBA PNG, or the same pixels as floats in [0, 1]."""

    def __init__(self, files: list[bytes], floats: bool = False):
        self.files, self.floats = files, floats

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        array = np.asarray(Image.open(io.BytesIO(self.files[index])))
        return (array / 255 if self.floats else array), index % 2


@pytest.mark.parametrize("floats", [False, True], ids=["uint8", "float"])
def test_an_rgba_array_is_blended_over_white_as_its_png_file_is(floats):
    """An RGBA array's colour under a transparent pixel is whatever the file kept there (often
    black): dropping alpha trained on that, while predict shows the model the file on white."""
    data, rgba = kinds.rgba_png()
    alpha = rgba[:, :, 3:].astype(np.float64) / 255
    over_white = rgba[:, :, :3] * alpha + 255 * (1 - alpha)
    loaded = load_user_data(FileArrays([data, data], floats), FileArrays([data, data], floats),
                            TrainConfig(in_memory="never"))
    blended = loaded.train.image(0).permute(1, 2, 0).numpy()
    assert np.abs(blended - over_white).max() <= 0.5 + 1e-9
