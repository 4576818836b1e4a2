"""benchmarks/make_imagenet_like.py: the folder it writes has ImageNet's sizes and bytes and
photograph-like content, in the layout accel_train reads, and is a function of its seed.

Checked with PIL (an independent reader), not with the product's decoder; a small folder (32
images, about a second).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import make_imagenet_like as maker  # noqa: E402

CLASSES, PER_CLASS = 4, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet_like")
    files = maker.make_folder(root, CLASSES, PER_CLASS, val_per_class=1, seed=0)
    return root, files


def _jpeg_size(pixels: np.ndarray) -> int:
    return len(maker.jpeg_bytes(Image.fromarray(pixels, "RGB")))


def test_layout_is_an_image_folder_accel_train_indexes(folder, tmp_path):
    from accel_train.data.imagefolder import index_folder
    root, files = folder
    assert len(files) == CLASSES * (PER_CLASS + 1)
    assert all(f.suffix == ".jpg" and f.parent.parent.name in ("train", "val") for f in files)
    index = index_folder(root, cache_dir=tmp_path / "cache", say=lambda *_: None)
    assert index.class_names == [maker.class_name(c) for c in range(CLASSES)]
    counts = sorted(len(paths) for paths, _ in index.splits.values())
    assert counts == [CLASSES, CLASSES * PER_CLASS]


def test_files_are_rgb_jpegs_that_pil_decodes(folder):
    for path in folder[1]:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert (image.format, image.mode) == ("JPEG", "RGB")
            image.load()


def test_sizes_and_aspect_ratios_are_imagenets(folder):
    sizes = maker.image_sizes(folder[1])
    assert all(300 <= min(size) <= 500 for size in sizes), sizes
    aspects = [w / h for w, h in sizes]
    assert all(0.5 <= a <= 16 / 9 + 0.01 for a in aspects), aspects
    assert any(a > 1 for a in aspects) and any(a < 1 for a in aspects)  # both orientations
    width, height = np.mean(sizes, axis=0)
    assert 400 < width < 540 and 330 < height < 450  # ImageNet's mean: 469x387


def test_mean_file_size_is_imagenets(folder):
    mean_kb = np.mean([path.stat().st_size for path in folder[1]]) / 1000
    assert 80 <= mean_kb <= 140, mean_kb  # ImageNet train: 115 kB


def test_content_compresses_like_a_photograph_not_like_noise_or_flat_colour(folder):
    rng = np.random.default_rng(0)
    for path in folder[1][::4]:
        pixels = np.asarray(Image.open(path).convert("RGB"))
        size = path.stat().st_size
        noise = _jpeg_size(rng.integers(0, 256, pixels.shape, dtype=np.uint8))
        flat = _jpeg_size(np.full_like(pixels, 128))
        assert size < 0.75 * noise, (path.name, size, noise)
        assert size > 20 * flat, (path.name, size, flat)
        # neighbouring pixels alike (photographs: mostly 0.8-0.97; noise: ~0)
        light = pixels.astype(np.float64).mean(axis=2)
        assert np.corrcoef(light[:, :-1].ravel(), light[:, 1:].ravel())[0, 1] > 0.6, path.name


def test_classes_differ_enough_to_learn(folder):
    """A nearest-class-mean rule on 8x8 thumbnails, leave one out, beats chance by far."""
    train = [path for path in folder[1] if path.parent.parent.name == "train"]
    thumbs = np.stack([np.asarray(Image.open(p).convert("RGB").resize((8, 8)), np.float64).ravel()
                       for p in train])
    labels = np.array([int(p.parent.name[1:]) for p in train])
    right = 0
    for i in range(len(train)):
        keep = np.arange(len(train)) != i
        means = np.stack([thumbs[keep & (labels == c)].mean(axis=0) for c in range(CLASSES)])
        right += int(np.argmin(((means - thumbs[i]) ** 2).sum(axis=1)) == labels[i])
    assert right / len(train) >= 0.6  # chance: 0.25


def test_deterministic_from_the_seed():
    def encoded(seed):
        return maker.jpeg_bytes(maker.render(seed, 1, "train", 3))
    assert encoded(0) == encoded(0)
    assert encoded(0) != encoded(1)
    assert maker.render(0, 1, "train", 3).size == Image.open(io.BytesIO(encoded(0))).size
