"""An ImageNet-like JPEG folder for benchmarks (no ImageNet is available here): N classes x M
photo-sized JPEGs in the image-folder layout accel_train reads (docs/data.md, "Image folders"):
DIR/train/CLASS/*.jpg, and with --val-per-class DIR/val/CLASS/*.jpg.

What makes it ImageNet-like is what an input pipeline pays for, not what a model sees:

- Sizes: the shorter side 300-500 px, landscape 4:3 and 3:2 most often, then portrait 3:4 and
  2:3, square, and some 16:9; the mean comes out near ImageNet's commonly quoted average of
  469x387 (linked to image-net.org's ILSVRC 2014 page; not re-measured here).  Many ImageNet
  photos are Flickr's 500 px "medium" size: 500x375, 500x333.
- Bytes: about 110 kB a file.  ILSVRC2012_img_train.tar is "138GB" on image-net.org's download
  page, 147,897,477,120 bytes exactly, for 1,281,167 training images (ILSVRC-2012; Russakovsky
  et al., IJCV 2015): 115 kB (113 KiB) a file, tar headers included.  Baseline JPEG with 4:2:0
  chroma (PIL's defaults, as most web photos are).
- Content that compresses and decodes like a photograph: a 1/f^beta random field (the power
  spectrum of natural images, beta about 2), chroma smoother than luminance, a few soft-edged
  objects (occluding shapes, the edges of a scene), a faint oriented texture, and mild sensor
  grain.  Flat noise would cost the JPEG coder and decoder far more than a photograph of the same
  size; flat colour far less.
- Classes differ in palette, object shape, spectrum slope and texture orientation, so a model has
  something to learn (the benchmarks only time the input path).

Deterministic from --seed: image i of class c is a function of (seed, c, split, i) alone.  About
25 ms an image on one core.

    python benchmarks/make_imagenet_like.py /tmp/imagenet_like --classes 10 --per-class 40
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# ImageNet's figures (the docstring cites them): mean training file, mean resolution.
IMAGENET_FILE_KB = 115
IMAGENET_MEAN_SIZE = (469, 387)
# Tuned once so that the content below averages ~110 kB a file (tests/test_imagenet_like.py
# checks that it stays in range): a high quality, as photo sites keep; the content does the rest.
QUALITY = 93
# (width / height, weight): ImageNet's mix, landscape-heavy.
ASPECTS = ((4 / 3, 0.42), (3 / 2, 0.20), (1.0, 0.10), (3 / 4, 0.12), (2 / 3, 0.06),
           (16 / 9, 0.06), (5 / 4, 0.04))
SHORT_SIDE = (300, 500)
SHAPES = ("ellipse", "polygon", "rectangle", "stripes")


def class_name(index: int) -> str:
    return f"n{index:08d}"  # ImageNet's class folders are WordNet ids: n01440764, ...


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): the shorter side in SHORT_SIDE, more often near its low end (the mean
    comes out near ImageNet's: its commonest sizes are 500x375 and 500x333)."""
    aspects, weights = zip(*ASPECTS)
    aspect = aspects[rng.choice(len(aspects), p=np.array(weights) / sum(weights))]
    short = int(round(rng.triangular(SHORT_SIDE[0], SHORT_SIDE[0], SHORT_SIDE[1])))
    long = int(round(short * max(aspect, 1 / aspect)))
    return (long, short) if aspect >= 1 else (short, long)


def class_traits(seed: int, index: int) -> dict:
    """What all images of a class share."""
    rng = np.random.default_rng([seed, index, 0xC1A55])
    return {"background": rng.uniform(40, 200, 3), "objects": rng.uniform(20, 235, (3, 3)),
            "shape": SHAPES[index % len(SHAPES)], "beta": rng.uniform(1.7, 2.3),
            "angle": rng.uniform(0, np.pi), "period": rng.uniform(6, 24),
            "count": int(rng.integers(2, 6))}


def pink_field(rng: np.random.Generator, height: int, width: int, beta: float) -> np.ndarray:
    """A random field with power spectrum 1/f^beta (f: cycles per image), unit std, float32:
    structure at every scale, like natural scenes (beta ~2), not the flat spectrum of noise."""
    fy = np.fft.fftfreq(height)[:, None] * height
    fx = np.fft.rfftfreq(width)[None, :] * width
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    spectrum = (rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) * f ** (-beta / 2)
    spectrum[0, 0] = 0
    field = np.fft.irfft2(spectrum, s=(height, width)).astype(np.float32)
    return field / (field.std() + 1e-8)


def _object_mask(rng: np.random.Generator, shape: str, width: int, height: int):
    """(alpha float32 [h, w, 1] in 0-1, (top, left)): one object's soft-edged mask, cut to the
    box it covers (blending the whole image per object would cost several times more)."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    rx, ry = rng.uniform(0.08, 0.35) * width, rng.uniform(0.08, 0.35) * height
    if shape == "ellipse":
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=255)
    elif shape == "rectangle":
        draw.rectangle((cx - rx, cy - ry, cx + rx, cy + ry), fill=255)
    elif shape == "polygon":
        angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(5, 9))))
        radius = rng.uniform(0.5, 1.0, len(angles))
        draw.polygon([(cx + rx * r * np.cos(a), cy + ry * r * np.sin(a))
                      for a, r in zip(angles, radius)], fill=255)
    else:  # a band of parallel stripes across the image (fences, shelves, blinds)
        step = max(6.0, rx / 3)
        for k in range(int(rng.integers(3, 7))):
            y = cy - ry + 2 * k * step
            draw.rectangle((0, y, width, y + step), fill=255)
    left, top, right, bottom = mask.getbbox() or (0, 0, 1, 1)
    box = (max(0, left - 4), max(0, top - 4), min(width, right + 4), min(height, bottom + 4))
    # soft edges: optics blur an edge over a pixel or two
    soft = mask.crop(box).filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.5)))
    return np.asarray(soft, dtype=np.float32)[..., None] / 255, (box[1], box[0])


def render(seed: int, class_index: int, split: str, index: int) -> Image.Image:
    """One RGB image, a function of its arguments alone."""
    traits = class_traits(seed, class_index)
    rng = np.random.default_rng([seed, class_index, sum(map(ord, split)), index])  # split: a number
    width, height = image_size(rng)
    # Luminance: the 1/f^beta scene; chroma: smoother (colour varies more slowly than light).
    light = pink_field(rng, height, width, traits["beta"]) * rng.uniform(38, 52)
    chroma = pink_field(rng, height, width, traits["beta"] + 0.6)
    tint = rng.standard_normal(3).astype(np.float32) * 12
    image = (traits["background"] + rng.normal(0, 15, 3)).astype(np.float32) \
        + light[..., None] + chroma[..., None] * tint
    # The class's texture: a grating at its own angle and period, on its objects' surfaces.
    angle = traits["angle"] + rng.normal(0, 0.15)
    ramp_x = np.arange(width, dtype=np.float32) * np.float32(np.cos(angle))
    ramp_y = np.arange(height, dtype=np.float32)[:, None] * np.float32(np.sin(angle))
    grating = np.sin((ramp_x + ramp_y) * np.float32(2 * np.pi / traits["period"]))
    for k in range(traits["count"] + int(rng.integers(0, 3))):
        alpha, (top, left) = _object_mask(rng, traits["shape"], width, height)
        where = (slice(top, top + alpha.shape[0]), slice(left, left + alpha.shape[1]))
        colour = (traits["objects"][k % 3] + rng.normal(0, 12, 3)).astype(np.float32)
        surface = colour + (light[where] * np.float32(rng.uniform(0.3, 0.7))
                            + grating[where] * np.float32(rng.uniform(4, 9)))[..., None]
        image[where] += alpha * (surface - image[where])
    image += rng.standard_normal((height, width, 1), dtype=np.float32) * 3.5  # sensor grain
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def jpeg_bytes(image: Image.Image, quality: int = QUALITY) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)  # baseline, 4:2:0 (PIL's defaults)
    return out.getvalue()


def _write(job: tuple) -> Path:
    path, seed, c, split, i, quality = job
    path.write_bytes(jpeg_bytes(render(seed, c, split, i), quality))
    return path


def make_folder(root, classes: int = 10, per_class: int = 40, val_per_class: int = 0,
                seed: int = 0, quality: int = QUALITY, workers: int = 1) -> list[Path]:
    """Writes root/train/CLASS/*.jpg (and root/val/CLASS/*.jpg); returns the files written.
    `workers` processes share the images (each file is a function of its name alone)."""
    jobs = []
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes if count else 0):
            folder = Path(root) / split / class_name(c)
            folder.mkdir(parents=True, exist_ok=True)
            jobs += [(folder / f"{class_name(c)}_{i}.jpg", seed, c, split, i, quality)
                     for i in range(count)]
    if workers <= 1:
        return [_write(job) for job in jobs]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(_write, jobs, chunksize=16)


def image_sizes(files: list[Path]) -> list[tuple[int, int]]:
    """(width, height) of each file, from its header."""
    sizes = []
    for path in files:
        with Image.open(path) as image:
            sizes.append(image.size)
    return sizes


def describe(files: list[Path]) -> str:
    sizes = image_sizes(files)
    kb = np.mean([f.stat().st_size for f in files]) / 1000
    width, height = np.mean(sizes, axis=0)
    return (f"{len(files)} files, mean {kb:.0f} kB (ImageNet train: {IMAGENET_FILE_KB} kB), mean "
            f"size {width:.0f}x{height:.0f} (ImageNet: {'x'.join(map(str, IMAGENET_MEAN_SIZE))})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("root", help="the folder to write (DIR/train/CLASS/*.jpg)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=40, help="training images per class")
    parser.add_argument("--val-per-class", type=int, default=0,
                        help="held-out images per class, under DIR/val (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", type=int, default=QUALITY, help="JPEG quality")
    parser.add_argument("--workers", type=int, default=1, help="processes writing images")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    files = make_folder(args.root, args.classes, args.per_class, args.val_per_class, args.seed,
                        args.quality, args.workers)
    print(f"{args.root}: {describe(files)}; {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
