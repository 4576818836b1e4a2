"""`accel-train shard --max-side N`: images whose longer side exceeds N stored at N, the others
byte for byte.  Oracles: the source files opened with PIL (EXIF turned by `ImageOps.
exif_transpose`, transparency blended over white by hand) and resized by PIL's Lanczos filter;
the shards read back with tarfile."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from conftest import accel_train_here

MAX_SIDE = 500


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth shapes and mild noise: compresses and resizes as photographs do, not as noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = [127 + 100 * np.sin(x / (30 + 20 * c) + rng.uniform(0, 6))
                * np.cos(y / (40 + 10 * c) + rng.uniform(0, 6)) for c in range(3)]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def turned_jpeg(path: Path, image: Image.Image, orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(path, quality=92, exif=exif)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    for split in ("train", "val"):
        for name in "abcde":
            (root / split / name).mkdir(parents=True)
            photo(40, 30, 99).save(root / "val" / name / "v.png") if split == "val" else None
    photo(1200, 800, 1).save(root / "train/a/wide.jpg", quality=92)
    photo(300, 200, 2).save(root / "train/b/small.jpg", quality=92)
    rgba = np.dstack([np.asarray(photo(900, 1500, 3)),
                      np.tile(np.linspace(0, 255, 900, dtype=np.uint8), (1500, 1))])
    Image.fromarray(rgba, "RGBA").save(root / "train/c/tall.png")
    turned_jpeg(root / "train/d/turned.jpg", photo(1000, 600, 4), 6)  # shown 600 wide, 1000 tall
    photo(4000, 3000, 5).save(root / "train/e/camera.jpg", quality=92)
    return root


@pytest.fixture(scope="module")
def stored(folder, tmp_path_factory) -> dict[int, tuple[str, bytes]]:
    """The training shards' (extension, bytes) by class index (one image a class)."""
    out = tmp_path_factory.mktemp("shards") / "max_side"
    result = accel_train_here("shard", "--no-progress", "--data-dir", str(folder), "--output",
                              str(out), "--max-side", str(MAX_SIDE), check=True)
    assert f"4 stored at a longer side of {MAX_SIDE} px (--max-side)" in result.stdout
    index = json.loads((out / "index.json").read_text())
    assert index["class_names"] == list("abcde")
    samples: dict[str, dict[str, bytes]] = {}
    for entry in index["splits"]["train"]:
        with tarfile.open(out / entry["file"]) as tar:
            for member in tar.getmembers():
                key, ext = member.name.rsplit(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    by_class = {}
    for sample in samples.values():
        label = int(sample.pop("cls"))
        (ext, data), = sample.items()
        by_class[label] = (ext, data)
    return by_class


def lanczos(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(image.convert("RGB").resize(size, Image.Resampling.LANCZOS)).astype(float)


def decoded(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def as_jpeg(pixels: np.ndarray) -> bytes:
    """PIL's JPEG at quality 95 (what a resized JPEG is stored as)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def test_an_image_within_the_side_is_stored_as_it_was(folder, stored):
    assert stored[1] == ("jpg", (folder / "train/b/small.jpg").read_bytes())


def test_a_wide_jpeg_is_resized_to_the_side_and_stays_a_jpeg(folder, stored):
    ext, data = stored[0]
    image = decoded(data)
    assert (ext, image.format, image.size) == ("jpg", "JPEG", (500, 333))  # 800 x 500/1200
    expected = lanczos(Image.open(folder / "train/a/wide.jpg"), (500, 333))
    assert data == as_jpeg(expected)  # no reduced decode here: 600x400 is under 2 x 500x333


def test_a_transparent_png_is_blended_over_white_resized_and_stays_lossless(folder, stored):
    ext, data = stored[2]
    image = decoded(data)
    assert (ext, image.format, image.mode, image.size) == ("png", "PNG", "RGB", (300, 500))
    rgba = np.asarray(Image.open(folder / "train/c/tall.png")).astype(np.uint32)
    alpha = rgba[:, :, 3:]
    over_white = ((rgba[:, :, :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    expected = lanczos(Image.fromarray(over_white), (300, 500))
    assert np.array_equal(np.asarray(image), expected)


def test_a_turned_jpeg_is_stored_upright_at_the_side(folder, stored):
    ext, data = stored[3]
    image = decoded(data)
    assert (ext, image.size) == ("jpg", (300, 500))
    assert image.getexif().get(0x0112, 1) == 1  # nothing left to turn
    expected = lanczos(ImageOps.exif_transpose(Image.open(folder / "train/d/turned.jpg")),
                       (300, 500))
    assert data == as_jpeg(expected)


def test_a_camera_sized_jpeg_decoded_at_a_reduced_scale_is_close_to_the_full_decode(folder,
                                                                                   stored):
    """4000x3000 to 500x375: decoded at a quarter (1000x750, twice the target) first."""
    ext, data = stored[4]
    image = decoded(data)
    assert (ext, image.size) == ("jpg", (500, 375))
    expected = lanczos(Image.open(folder / "train/e/camera.jpg"), (500, 375))
    difference = np.abs(np.asarray(image.convert("RGB")).astype(float) - expected).mean()
    # against what storing the full decode's resize would have cost
    stored_full = np.asarray(decoded(as_jpeg(expected)).convert("RGB")).astype(float)
    baseline = np.abs(stored_full - expected).mean()
    assert difference < baseline + 0.1, (difference, baseline)  # measured: 1.701 against 1.696
    assert data != as_jpeg(expected)  # (and it was decoded reduced: not the full decode's bytes)


@pytest.mark.parametrize("value", ["8", "0", "-3"])
def test_a_side_too_small_is_refused_before_anything_is_written(folder, tmp_path, value):
    out = tmp_path / "shards"
    result = accel_train_here("shard", "--no-progress", "--data-dir", str(folder), "--output",
                              str(out), "--max-side", value)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--max-side" in result.stderr
    assert f"(got {value})" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and not out.with_name("shards.partial").exists()
