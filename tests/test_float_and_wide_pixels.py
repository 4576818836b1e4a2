"""Pixels stored wider than 8 bits that are not 16-bit images: float TIFFs (PIL mode F) and
32-bit integer TIFFs (mode I).  Each becomes its own picture or is refused with its range, never
a black or white square (what PIL's convert("RGB") makes of a 0..1 float image, or of int32
values above 255).

Oracles: the uint8 arrays the files are made from (numpy), written with PIL's own TIFF writer.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

import imagekinds as kinds
from accel_train.cli import main
from accel_train.data.decode import Unreadable, decode


def tiff(values: np.ndarray) -> bytes:
    return kinds.encoded(values, "TIFF")


def gray_rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[:, :, None], 3, axis=2)


def decoded(data: bytes) -> np.ndarray:
    return decode(data).permute(1, 2, 0).numpy()


def test_a_float_tiff_of_0_to_1_is_its_8_bit_picture():
    """Pixels / 255 (how float images are made from 8-bit ones) come back exactly."""
    gray = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert Image.open(io.BytesIO(tiff(gray.astype(np.float32) / 255))).mode == "F"
    assert np.array_equal(decoded(tiff(gray.astype(np.float32) / 255)), gray_rgb(gray))


def test_a_float_tiff_of_0_to_255_is_kept():
    gray = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(decoded(tiff(gray.astype(np.float32))), gray_rgb(gray))


FLOAT_RANGE = ("floating-point pixels from {} to {}, neither 0..1 nor 0..255: save it as an "
               "8- or 16-bit image")


@pytest.mark.parametrize("values, reason", [
    (np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), FLOAT_RANGE.format(-1, 1)),
    (np.linspace(0, 65535, 64, dtype=np.float32).reshape(8, 8), FLOAT_RANGE.format(0, 65535)),
    (np.array([[0.5, np.nan], [0.2, 0.1]], dtype=np.float32),
     "floating-point pixels holding not a number or an infinity"),
    (np.array([[0, 255.5], [3, 4]], dtype=np.float32), FLOAT_RANGE.format(0, 255.5)),
], ids=["normalized", "16-bit-range", "nan", "just-past-255"])
def test_a_float_tiff_of_another_range_is_unreadable_saying_its_range(values, reason):
    with pytest.raises(Unreadable) as caught:
        decode(tiff(values))
    assert caught.value.reason == reason


def test_a_float_tiff_just_past_1_is_read_as_0_to_255():
    """The boundaries: a maximum of 2 is no 0..1 image (scaled, it would wrap past 255): its
    values as PIL's convert keeps them."""
    values = np.array([[0, 1], [2, 1.5]], dtype=np.float32)
    expected = np.asarray(Image.fromarray(values, "F").convert("L"))
    assert np.array_equal(decoded(tiff(values)), gray_rgb(expected))


def test_a_32_bit_integer_tiff_within_16_bits_is_scaled_as_16_bit_images_are():
    values = np.arange(0, 65536, 256, dtype=np.int32).reshape(16, 16)
    values[-1, -1] = 65535  # the largest 16-bit value stays readable
    assert np.array_equal(decoded(tiff(values)), gray_rgb((values >> 8).astype(np.uint8)))


@pytest.mark.parametrize("low, high", [(0, 1_000_000), (-5, 200), (0, 65536)])
def test_a_32_bit_integer_tiff_beyond_16_bits_is_unreadable_saying_its_range(low, high):
    values = np.linspace(low, high, 64).astype(np.int32).reshape(8, 8)
    with pytest.raises(Unreadable) as caught:
        decode(tiff(values))
    assert caught.value.reason == (f"integer pixels from {low} to {high}, beyond 16 bits "
                                   f"(0..65535): save it as an 8- or 16-bit image")


def test_check_data_names_the_float_tiff_it_cannot_read(tmp_path, capsys):
    for label in ("ant", "bee"):
        (tmp_path / label).mkdir()
        for i in range(2):
            Image.fromarray(kinds.pixels(i)).save(tmp_path / label / f"{i}.png")
    (tmp_path / "ant" / "depth.tif").write_bytes(
        tiff(np.linspace(0, 5000, 64, dtype=np.float32).reshape(8, 8)))
    (tmp_path / "bee" / "scan.tif").write_bytes(
        tiff(kinds.pixels(3)[:, :, 0].astype(np.float32) / 255))
    capsys.readouterr()
    code = main(["check-data", "--data-dir", str(tmp_path), "--json", "--workers", "1"])
    findings = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [(u["image"], u["reason"]) for u in findings["unreadable"]] == \
        [("ant/depth.tif", FLOAT_RANGE.format(0, 5000))]
