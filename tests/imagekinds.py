"""Generated image files of the kinds people collect, broken and odd, for the data tests.

Every file is made here with PIL (or, for 16-bit RGB PNG, which PIL cannot write, with a
few lines of PNG chunks), from known pixel arrays, so that tests can compare what the product
decodes with values computed independently (numpy).
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

HTML = b"<!DOCTYPE html><html><body>403 Forbidden</body></html>\n"


def pixels(seed: int, height: int = 12, width: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encoded(array: np.ndarray, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt, **options)
    return buffer.getvalue()


# -- broken files: name -> bytes, and the words the reason must contain -------------------------
def broken_files(seed: int = 0) -> dict[str, tuple[bytes, str]]:
    jpeg = encoded(pixels(seed, 64, 64), "JPEG", quality=90)
    png = encoded(pixels(seed + 1, 64, 64), "PNG")
    return {"truncated.jpg": (jpeg[: len(jpeg) // 2], "truncated"),
            "truncated.png": (png[: len(png) * 2 // 3], "truncated"),
            "empty.jpg": (b"", "empty file"),
            "page.jpg": (HTML, "holds text"),
            "garbage.png": (bytes(range(256)) * 4, "not an image")}


# -- odd files that decode -------------------------------------------------------------------------
def exif_oriented_jpeg(array: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(array, "JPEG", quality=95, exif=exif)


def exif_oriented_png(array: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(array, "PNG", exif=exif)


def oriented(array: np.ndarray, orientation: int) -> np.ndarray:
    """What an image with this EXIF orientation looks like upright (the EXIF 2.3 table),
    with numpy: 2 mirror, 3 half turn, 4 upside-down mirror, 5 transpose, 6 quarter turn
    clockwise, 7 transverse, 8 quarter turn counter-clockwise."""
    return {1: lambda a: a, 2: np.fliplr, 3: lambda a: np.rot90(a, 2), 4: np.flipud,
            5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, -1),
            7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
            8: lambda a: np.rot90(a, 1)}[orientation](array)


def png16_gray(values: np.ndarray) -> bytes:
    return encoded(values.astype(np.uint16), "PNG")  # PIL mode I;16


def png16_rgb(values: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG written chunk by chunk (PIL cannot write one)."""
    height, width, _ = values.shape
    raw = b"".join(b"\x00" + values[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def animated_gif(colors: list[tuple[int, int, int]], size: int = 8) -> bytes:
    frames = [Image.new("RGB", (size, size), color) for color in colors]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50,
                   loop=0)
    return buffer.getvalue()


def palette_with_transparency(size: int = 8) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A palette PNG whose index 0 is transparent; (bytes, index array, palette [256, 3])."""
    rng = np.random.default_rng(3)
    indices = rng.integers(0, 4, (size, size), dtype=np.uint8)
    palette = np.zeros((256, 3), dtype=np.uint8)
    palette[:4] = [[10, 20, 30], [200, 0, 0], [0, 200, 0], [0, 0, 200]]
    image = Image.fromarray(indices, "P")
    image.putpalette(palette.flatten().tolist())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=0)
    return buffer.getvalue(), indices, palette


def rgba_png(size: int = 8) -> tuple[bytes, np.ndarray]:
    array = np.random.default_rng(4).integers(0, 256, (size, size, 4), dtype=np.uint8)
    return encoded(array, "PNG"), array


def cmyk_tiff(size: int = 8) -> tuple[bytes, np.ndarray]:
    array = np.random.default_rng(5).integers(0, 256, (size, size, 4), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array, "CMYK").save(buffer, format="TIFF")
    return buffer.getvalue(), array


def cmyk_jpeg(size: int = 16) -> bytes:
    array = np.random.default_rng(6).integers(0, 256, (size, size, 4), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array, "CMYK").save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def bomb_png(width: int = 9500, height: int = 9500) -> bytes:
    """A 1-bit PNG of width x height pixels (9500 x 9500 = 90.25 million: over PIL's default
    limit of 89.5 million) that is a few kB on disk."""
    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


# -- folders --------------------------------------------------------------------------------------
def write_folder(root: Path, classes=("ant", "bee"), per_class: int = 24, held_out: int = 4,
                 size: int = 16) -> Path:
    """root/train/CLASS/NNN.png and root/val/CLASS/NNN.png of random pixels (a label-dependent
    brightness, so there is something to learn)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", held_out)):
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                array = (rng.uniform(0, 120, (size, size, 3)) + 100 * label).clip(0, 255)
                Image.fromarray(array.astype(np.uint8)).save(root / split / name / f"{i:03d}.png")
    return root
