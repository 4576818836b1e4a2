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
    photo(2000, 1500, 5).save(root / "train/e/camera.jpg", quality=92)
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
    """2000x1500 to 500x375: decoded at half the size (1000x750, twice the target) first."""
    ext, data = stored[4]
    image = decoded(data)
    assert (ext, image.size) == ("jpg", (500, 375))
    expected = lanczos(Image.open(folder / "train/e/camera.jpg"), (500, 375))
    difference = np.abs(np.asarray(image.convert("RGB")).astype(float) - expected).mean()
    # against what storing the full decode's resize would have cost
    stored_full = np.asarray(decoded(as_jpeg(expected)).convert("RGB")).astype(float)
    baseline = np.abs(stored_full - expected).mean()
    assert difference < baseline + 0.1, (difference, baseline)
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


# -- the start's note that points to it -------------------------------------------------------

@pytest.mark.parametrize("shapes, image_size, side", [
    ([(1536, 2048)] * 3, 224, 512),            # 2048 = 4 x 512: the note from here
    ([(3024, 4032), (1536, 2048), (100, 2100)], 224, 512),  # the median longer side: 2100
    ([(2304, 3072)], 384, 768),                # 2 x 384 = 768; 4 x 768 = 3072
    ([(2304, 3072)], 300, 640),                # 600 rounded up to 64 px: 640; 4 x 640 < 3072
    ([(2400, 2400)], 257, 576),                # 514 rounded up to 64 px: 576; 4 x 576 < 2400
])
def test_photos_four_times_the_suggested_side_are_noted_with_the_shard_command(shapes,
                                                                              image_size, side):
    from accel_train.data.large_photos import large_photo_note
    note = large_photo_note(shapes, image_size, "--data-dir photos")
    assert f"`accel-train shard --data-dir photos --output SHARDS --max-side {side}`" in note
    assert f"for {image_size} px crops" in note


def test_the_note_names_a_photo_of_the_median_longer_side():
    from accel_train.data.large_photos import large_photo_note
    note = large_photo_note([(3024, 4032), (1536, 2048), (2100, 100)], 224, "--data-dir photos")
    assert "a median longer side of 2100 px of 3 looked at, such as 100x2100)" in note, note


@pytest.mark.parametrize("shapes, image_size", [
    ([(1536, 2047)] * 3, 224),                 # under 4 x 512
    ([(3024, 4032), (375, 500), (333, 500)], 224),  # the median is ImageNet's 500
    ([(2304, 3071)], 384),                     # under 4 x 768
    ([], 224),
])
def test_photos_under_four_times_the_suggested_side_are_not_noted(shapes, image_size):
    from accel_train.data.large_photos import large_photo_note
    assert large_photo_note(shapes, image_size, "--data-dir photos") is None


@pytest.mark.slow
def test_a_run_on_large_photos_names_the_shard_command_which_then_stores_them(tmp_path):
    """Through the CLI: photos decoded per step at 2400 px, trained at 96 px, get the note; the
    command it names, run as printed, writes shards of 512 px images, and training on them
    says nothing more."""
    import re
    import shlex
    for name in "ab":
        for k in range(3):
            (tmp_path / "big" / name).mkdir(parents=True, exist_ok=True)
            photo(2400 - 100 * k, 1500, k).save(tmp_path / "big" / name / f"{k}.jpg")
    common = ["--data-dir", str(tmp_path / "big"), "--model", "test_resnet", "--image-size",
              "96", "--max-steps", "1", "--batch-size", "4", "--warmup-epochs", "0"]
    run = accel_train_here(*common, "--in-memory", "never", "--output-dir",
                           str(tmp_path / "run"), check=True)
    said = run.stdout + run.stderr
    command = re.search(r"`accel-train (shard [^`]*)`", said)
    assert command and "a median longer side of 2300 px" in said, said
    args = shlex.split(command.group(1).replace("SHARDS", str(tmp_path / "shards")))
    accel_train_here(*args, "--no-progress", check=True)
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    with tarfile.open(tmp_path / "shards" / index["splits"]["train"][0]["file"]) as tar:
        image = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
        assert max(decoded(tar.extractfile(image).read()).size) == 512
    stored = accel_train_here(*common[2:], "--data-dir", str(tmp_path / "shards"),
                              "--output-dir", str(tmp_path / "stored"), check=True)
    assert "accel-train shard" not in stored.stdout + stored.stderr


# -- the function shard calls, file by file --------------------------------------------------

def jpeg_file(image: Image.Image, orientation: int = 1) -> bytes:
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(buffer, format="JPEG", quality=92, exif=exif)
    return buffer.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_exif_orientation_is_stored_upright_at_the_side(orientation):
    """1200x700 as stored: the quarter turns (5-8) are shown 700 wide, the others 1200."""
    from accel_train.data.streaming.max_side import within_max_side
    data = jpeg_file(photo(1200, 700, orientation), orientation)
    stored, ext, resized = within_max_side(data, "jpg", 500)
    size = (292, 500) if orientation >= 5 else (500, 292)  # 700 x 500/1200 = 291.7
    expected = lanczos(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), size)
    assert (ext, resized, decoded(stored).size) == ("jpg", True, size)
    assert stored == as_jpeg(expected)


def test_a_turned_photo_is_decoded_reduced_along_its_stored_sides():
    """2000x1200 stored, turned a quarter (shown 1200x2000), to 300x500: PIL's draft asked for
    twice the target on the stored sides (1000x600) decodes at half, 1000x600."""
    from accel_train.data.streaming.max_side import within_max_side
    data = jpeg_file(photo(2000, 1200, 7), 6)
    stored, _, _ = within_max_side(data, "jpg", 500)
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (1000, 600))
    assert image.size == (1000, 600)  # (what the reduced decode gives, by hand)
    assert stored == as_jpeg(lanczos(ImageOps.exif_transpose(image), (300, 500)))


def test_files_that_cannot_be_read_are_kept_as_they_are():
    from accel_train.data.streaming.max_side import within_max_side
    whole = jpeg_file(photo(2000, 1500, 8))
    for broken in (b"\xff\xd8\xff" + b"\x00" * 100, whole[:3000], b"not an image"):
        assert within_max_side(broken, "jpg", 500) == (broken, "jpg", False)


def test_the_sizes_at_the_boundaries():
    from accel_train.base.errors import UsageError
    from accel_train.data.streaming.max_side import check_max_side, target_size
    assert target_size(500, 300, 500) is None and target_size(300, 500, 500) is None
    assert target_size(501, 300, 500) == (500, 299)      # 300 x 500/501 = 299.4
    assert target_size(300, 501, 500) == (299, 500)
    assert target_size(640, 640, 500) == (500, 500)
    assert target_size(4000, 1, 500) == (500, 1) and target_size(1, 4000, 500) == (1, 500)
    assert check_max_side(16) == 16 and check_max_side(None) is None
    with pytest.raises(UsageError):
        check_max_side(15)
