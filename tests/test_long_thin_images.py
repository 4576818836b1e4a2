"""Held-out images of extreme aspect (a 1 x 4000 strip, a panorama) under crop_mode "center":
the crop is resampled from the region it keeps (data/centre_crop.py), not from the whole strip
resized first.

Oracles: timm's own eval transform (`timm.data.create_transform(is_training=False, ...)`) on the
same PIL image, for the pixels; the operating system's peak resident memory of a `predict`
process (os.wait4's rusage), for the cost: a strip's against an ordinary photo's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform

from accel_train.data.decode import decode, read_value
from accel_train.data.loaders import run_transforms
from accel_train.model.saved import ModelSpec
from conftest import REPO, TINY_TRAIN, accel_train_here, test_env
from test_timm_pipeline import parse

SIZE = 96

# (width, height), interpolation, crop_pct: strips both ways, a thin image, a panorama
STRIPS = {
    "1x4000 bilinear": ((1, 4000), "bilinear", 0.875),
    "4000x1 bicubic": ((4000, 1), "bicubic", 0.95),
    "17x900 lanczos": ((17, 900), "lanczos", 0.9),
    "600x60 hamming": ((600, 60), "hamming", 1.0),
    "panorama 90x700 bicubic": ((700, 90), "bicubic", 0.875),
}


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour waves along both sides and a little grain: a resize of pure noise would
    hide interpolation differences in the noise's own average."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([120 + 100 * np.sin(x / width * rng.uniform(2, 30) + rng.uniform(0, 6))
                       * np.cos(y / height * rng.uniform(1, 30)) for _ in range(3)], axis=-1)
    pixels += rng.normal(0, 6, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def held_out(interpolation: str, crop_pct: float):
    """The held-out transform a run with these held-out flags evaluates with, and timm's."""
    config = parse("--crop-mode", "center", "--crop-pct", str(crop_pct), "--interpolation",
                   interpolation)
    spec = ModelSpec("test_resnet", 1, ["a"], SIZE, (0.5,) * 3, (0.5,) * 3,
                     crop_pct=crop_pct, crop_mode="center", interpolation=interpolation)
    oracle = create_transform(SIZE, is_training=False, crop_pct=crop_pct, crop_mode="center",
                              interpolation=interpolation, use_prefetcher=True)
    return run_transforms(config, spec)[1], oracle


@pytest.mark.parametrize("case", STRIPS)
def test_a_long_thin_image_is_timms_centre_crop_within_a_level(case, tmp_path):
    """Within 1 level in 255, in under 1% of the pixels (PIL's float32 box moves a filter's
    centre by its last digit); measured over these and more shapes: 1 level at most, in 0.015%
    of the pixels."""
    (width, height), interpolation, crop_pct = STRIPS[case]
    path = tmp_path / "strip.png"
    photo(width, height, seed=width + height).save(path)
    transform, oracle = held_out(interpolation, crop_pct)
    got = transform.pixels(decode(read_value(str(path)))).int()
    expected = oracle(photo(width, height, seed=width + height)).int()
    assert got.shape == expected.shape == (3, SIZE, SIZE)
    difference = (got - expected).abs()
    assert int(difference.max()) <= 1
    assert float((difference > 0).float().mean()) < 0.01


def checkerboard(width: int, height: int) -> Image.Image:
    """Every pixel far from its neighbours: a filter's farthest lobes move the result by levels,
    where on a smooth photo they move it by fractions of one."""
    y, x = np.mgrid[0:height, 0:width]
    level = np.where((x + y) % 2 == 0, 20, 235).astype(np.uint8)
    return Image.fromarray(np.stack([level, 255 - level, level], axis=-1), "RGB")


def test_a_checkerboard_strip_keeps_every_source_pixel_the_filter_weighs(tmp_path):
    """Lanczos weighs 3 source pixels either side of each output pixel's centre: the region cut
    from the strip must hold them all.  Measured: none of the pixels differs from timm's; cut
    one pixel short of the filter's reach, 204 of 27,648 do (0.74%)."""
    path = tmp_path / "strip.png"
    checkerboard(17, 900).save(path)
    transform, oracle = held_out("lanczos", 0.9)
    difference = (transform.pixels(decode(read_value(str(path)))).int() -
                  oracle(checkerboard(17, 900)).int()).abs()
    assert int(difference.max()) <= 1
    assert float((difference > 0).float().mean()) < 0.001


@pytest.mark.parametrize("shape, interpolation", [((400, 100), "bicubic"), ((40, 300), "nearest"),
                                                  ((300, 1250), "bilinear")])
def test_ordinary_shapes_steps_and_shrinks_are_timms_own_bit_for_bit(shape, interpolation,
                                                                     tmp_path):
    """Up to 4:1, with a filter of steps (nearest), and where the shorter side shrinks, the
    pixels are timm's exactly."""
    path = tmp_path / "image.png"
    photo(*shape, seed=5).save(path)
    transform, oracle = held_out(interpolation, 0.875)
    assert torch.equal(transform.pixels(decode(read_value(str(path)))), oracle(photo(*shape, 5)))


def peak_memory_mib(*args: str) -> float:
    """`python -m accel_train ARGS` in a process of its own; its peak resident memory."""
    process = subprocess.Popen([sys.executable, "-m", "accel_train", *args], cwd=REPO,
                               env=test_env(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, output.decode()[-3000:]
    return usage.ru_maxrss / 1024


@pytest.mark.slow
def test_predict_on_a_long_strip_costs_no_more_memory_than_on_a_photo(tmp_path):
    """A 1 x 20000 strip at 96 px (crop_pct 0.875): timm's transform would resize it to
    109 x 2,180,000 pixels (713 MB) first.  Measured: peaks of 886 MiB on the photo and 886 on
    the strip; with every image through timm's transform, 900 and 1,743."""
    run = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--image-size", str(SIZE), "--crop-mode", "center",
                     "--crop-pct", "0.875", "--output-dir", str(run), check=True)
    strip, ordinary = tmp_path / "strip.png", tmp_path / "photo.png"
    photo(1, 20000, seed=1).save(strip)
    photo(100, 100, seed=2).save(ordinary)
    on_photo = peak_memory_mib("predict", str(run), str(ordinary))
    on_strip = peak_memory_mib("predict", str(run), str(strip))
    assert on_strip - on_photo < 100, (on_photo, on_strip)

