"""Image files -> uint8 CHW RGB tensors, for the files people really collect.

What each kind of file becomes:

- JPEG: libjpeg-turbo through torchvision's decoder (TorchCodec's where torchvision has none
  left: jpeg_decoders.py), a whole list in one call (faster than PIL, and pixel-identical to
  PIL's RGB), EXIF orientation applied; PIL gets the ones it cannot decode, and all of them
  where neither library is there.
- EXIF orientation (any format): applied, as PIL's `ImageOps.exif_transpose` does.
- 16-bit grayscale PNG/TIFF (PIL modes I;16*, I): scaled to 8 bits (v >> 8), not clipped at 255.
  16-bit RGB PNG: PIL keeps the high byte, which is the same scaling.  32-bit integer pixels
  beyond 0..65535: unreadable, saying their range.
- Float TIFF (PIL mode F): 0..1 scaled to 0..255 (rounded), 0..255 kept; any other range
  unreadable, saying it (PIL's convert would make a black or white square of it).
- Transparency (RGBA, LA, a palette or RGB image with a transparent colour): composited over
  white, the background an image viewer shows; dropping the alpha channel would put whatever
  colour the invisible pixels happen to hold (often black) into the training image.
- Animated GIF/PNG/WebP: the first frame.  Grayscale, palette and CMYK: converted to RGB.
- More pixels than PIL's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`, 89,478,485 by
  default): unreadable, with that reason, from the header alone; decoding it could exhaust memory.
  A JPEG is decoded at 1/2, 1/4 or 1/8 of its size instead, the largest within the limit
  (_reduced_jpeg).

A file that cannot be decoded raises `Unreadable` with a short reason (empty file, holds text,
truncated, ...): the caller names the file and decides what happens (sources.py).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import math
import os
import warnings
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from accel_train.data.jpeg_decoders import each_or_none, jpeg_decoder, pil_orientation
from accel_train.data.loader_watch import reading

_JPEG_MAGIC = b"\xff\xd8\xff"
_CPU = torch.device("cpu")
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_DEVICE_MODES = ("RGB", "L")  # PIL modes of the JPEGs nvJPEG turns into RGB as PIL does


class Unreadable(Exception):
    """An image file that cannot be decoded; `reason` says why in a few words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def read_value(value, root: Optional[Path] = None) -> Union[bytes, Image.Image]:
    """A datasets Image value (dict of bytes/path, or a PIL image) or a path -> the file's bytes
    (or the PIL image as it is).  Relative paths are relative to `root` (an indexed folder)."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (list, np.ndarray)):  # a column of pixel arrays (sources.py checks it)
        return array_image(np.asarray(value))
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if root is not None and not path.is_absolute():
            path = root / path
        try:
            with reading(lambda: str(path)):  # named if it never returns (loader_watch.py)
                return path.read_bytes()
        except FileNotFoundError:
            if path.is_symlink():  # never there: "gone" or "no file" would send one looking
                raise Unreadable(f"a broken symlink: its target {os.readlink(path)} does not "
                                 f"exist") from None
            if root is not None:  # an indexed folder's file: it was there
                raise Unreadable("the file is gone (deleted or moved since the data was "
                                 "indexed)") from None
            # a path stored in the data (a parquet column): say where it was looked for
            where = f"{path.absolute()}" + ("" if path.is_absolute() else
                                            ": a relative path, read from the current folder")
            raise Unreadable(f"no file at {where}") from None
        except OSError as err:
            raise Unreadable(f"cannot read the file ({err.strerror or err})") from None
    raise Unreadable(f"not an image value (got {type(value).__name__})")


CHANNELS = (1, 3, 4)  # gray, RGB, RGBA: the channel axis of a pixel array holds one of these


def array_layout(shape: tuple) -> Optional[str]:
    """"HW", "HWC" or "CHW" for a pixel array of this shape, or None where it is none of them or
    either of two (3 x 20 x 3): the channel axis is the first or the last, whichever alone has
    1, 3 or 4 entries (numpy and PIL put it last; torch and transformers' processors first)."""
    if len(shape) == 2:
        return "HW"
    if len(shape) != 3:
        return None
    first, last = shape[0] in CHANNELS, shape[2] in CHANNELS
    return "HWC" if last and not first else "CHW" if first and not last else None


def array_image(pixels: np.ndarray) -> Image.Image:
    """A whole-number pixel array (HW, HWC or CHW: array_layout) -> a PIL image, which decode()
    turns into RGB as it does a file's (gray widened, RGBA composited over white)."""
    layout = array_layout(pixels.shape)
    if layout is None:
        raise Unreadable(f"a pixel array of shape {pixels.shape}, neither HxW, HxWxC nor CxHxW "
                         f"with C 1, 3 or 4")
    if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
        raise Unreadable(f"pixel values from {pixels.min()} to {pixels.max()}, outside 0..255")
    if layout == "CHW":
        pixels = pixels.transpose(1, 2, 0)
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8))


def decode_many(items: list) -> list[Union[torch.Tensor, Unreadable]]:
    """decode() over a list: a tensor, or the Unreadable explaining why not, per item; the JPEGs
    among them go to the JPEG decoder in one call."""
    results: list = [None] * len(items)
    jpegs = [i for i, item in enumerate(items)
             if isinstance(item, bytes) and item.startswith(_JPEG_MAGIC)]
    for i, image in zip(jpegs, _decode_jpegs([items[i] for i in jpegs])):
        results[i] = image
    for i, item in enumerate(items):
        if results[i] is None:
            try:
                results[i] = decode(item, fast=False)
            except Unreadable as err:
                results[i] = err
    return results


def decode(item: Union[bytes, Image.Image], fast: bool = True) -> torch.Tensor:
    """File bytes (or a PIL image) -> uint8 [3, H, W] RGB; raises Unreadable."""
    if fast and isinstance(item, bytes) and item.startswith(_JPEG_MAGIC):
        image = _decode_jpegs([item])[0]
        if image is not None:
            return image
    if isinstance(item, bytes) and not item:
        raise Unreadable("empty file: 0 bytes")
    try:
        with warnings.catch_warnings():  # over the limit: an error, not a warning on stderr
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            pil = item if isinstance(item, Image.Image) else Image.open(io.BytesIO(item))
            pixels = _rgb_pixels(pil)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        if isinstance(item, bytes) and item.startswith(_JPEG_MAGIC):
            return _reduced_jpeg(item)
        raise Unreadable(_too_large(*pil_size(item))) from None
    except UnidentifiedImageError:
        raise Unreadable(_not_an_image(item)) from None
    except Unreadable:  # its pixels' own reason (_wide_gray)
        raise
    except Exception as err:  # noqa: BLE001 -- a broken file may raise anything; it is data
        raise Unreadable(_describe(err)) from None
    return torch.from_numpy(np.array(pixels)).permute(2, 0, 1)  # a writable copy


def jpeg_header(blob: bytes) -> Optional[tuple[int, int, int]]:
    """(height, width, EXIF orientation 1-8) of a JPEG, the size as decoded with the orientation
    applied, from its header alone; None when a GPU's decoder should not take it
    (device_decode.py): not a JPEG PIL can read, CMYK, over PIL's decompression-bomb limit
    (decoding it here names the problem)."""
    try:
        with warnings.catch_warnings():  # over the limit: the host path says what it does
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(blob))
        with pil:
            if pil.format != "JPEG" or pil.mode not in _DEVICE_MODES:
                return None
            width, height = pil.size
            orientation = pil_orientation(pil)
    except Exception:  # noqa: BLE001 -- a broken header is the host path's to name
        return None
    if width * height > _pixel_limit():
        return None
    if orientation in (5, 6, 7, 8):  # a quarter turn: the sides swap
        return width, height, orientation
    return height, width, orientation


# libjpeg's DCT scaling (PIL's draft): decodes at 1/2, 1/4 or 1/8 of the size without ever
# holding the whole image
_JPEG_REDUCTIONS = (2, 4, 8)


def _reduced_jpeg(blob: bytes) -> torch.Tensor:
    """A JPEG over the pixel limit (a 100-megapixel camera's photo: 11648x8736), decoded at the
    largest of 1/2, 1/4 or 1/8 of its size that is within the limit, by libjpeg's DCT scaling
    (PIL's draft), which never holds the whole image: training at a few hundred pixels loses
    nothing by it, where refusing every such photo trained on none of them.  Over the limit
    even at 1/8 (64 times it): unreadable, as any other image over it."""
    try:
        with _limit_lifted():  # one open: its header gives the size, then draft decodes
            pil = Image.open(io.BytesIO(blob))
        width, height = pil.size
        limit = _pixel_limit()
        reduction = next((r for r in _JPEG_REDUCTIONS
                          if math.ceil(width / r) * math.ceil(height / r) <= limit), None)
        if reduction is None:
            raise Unreadable(_too_large(width, height))
        # (draft takes the largest scale whose floor-divided size still covers the one asked)
        pil.draft("RGB", (max(1, width // reduction), max(1, height // reduction)))
        if pil.size[0] * pil.size[1] > limit:  # a side shorter than the reduction
            raise Unreadable(_too_large(width, height))
        pixels = _rgb_pixels(pil)
    except Unreadable:
        raise
    except Exception as err:  # noqa: BLE001 -- a broken file may raise anything; it is data
        raise Unreadable(_describe(err)) from None
    return torch.from_numpy(np.array(pixels)).permute(2, 0, 1)


@contextlib.contextmanager
def _limit_lifted():
    """PIL's decompression-bomb limit lifted while a header is read (PIL's open checks it, with
    no per-call setting): for a size this module checks itself."""
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def pil_size(item) -> tuple[int, int]:
    """(width, height) from the header alone, without the decompression-bomb check."""
    if isinstance(item, Image.Image):
        return item.size
    with _limit_lifted(), Image.open(io.BytesIO(item)) as pil:
        return pil.size


def _rgb_pixels(pil: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3]: orientation applied, 16 bits scaled, transparency over white."""
    if pil_orientation(pil) != 1:
        pil = ImageOps.exif_transpose(pil)
    if pil.mode in _SIXTEEN_BIT_MODES or pil.mode == "F":
        return np.repeat(_wide_gray(pil)[:, :, None], 3, axis=2)
    if pil.mode in _ALPHA_MODES or "transparency" in pil.info:
        rgba = np.asarray(pil.convert("RGBA")).astype(np.uint32)
        alpha = rgba[:, :, 3:]
        return ((rgba[:, :, :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    return np.asarray(pil.convert("RGB"))


def _wide_gray(pil: Image.Image) -> np.ndarray:
    """uint8 [H, W] of a gray image stored in more than 8 bits.  Integers (16-bit PNG/TIFF, and
    32-bit TIFFs holding 16-bit values): v >> 8.  Floats (mode F TIFFs): 0..1, the float
    convention, scaled by 255 and rounded (pixels / 255 come back exactly); 0..255 kept as
    PIL's convert keeps them.  Any other range is no picture one rule could recover (a depth
    map in metres, normalized values): unreadable, saying the range, where PIL's convert
    would clip it to a black or white square without a word."""
    values = np.asarray(pil)
    if pil.mode == "F":
        if not np.isfinite(values).all():
            raise Unreadable("floating-point pixels holding not a number or an infinity")
        low, high = float(values.min()), float(values.max())
        if low >= 0 and high <= 1:
            return np.rint(values.astype(np.float64) * 255).astype(np.uint8)
        if low >= 0 and high <= 255:
            return np.asarray(pil.convert("L"))
        raise Unreadable(f"floating-point pixels from {low:g} to {high:g}, neither 0..1 nor "
                         f"0..255: save it as an 8- or 16-bit image")
    low, high = int(values.min()), int(values.max())
    if low < 0 or high > 65535:  # a 32-bit integer TIFF
        raise Unreadable(f"integer pixels from {low} to {high}, beyond 16 bits (0..65535): "
                         f"save it as an 8- or 16-bit image")
    return (values.astype(np.int64) >> 8).astype(np.uint8)


def _decode_jpegs(blobs: list[bytes]) -> list[Optional[torch.Tensor]]:
    """JPEG bytes -> uint8 CHW RGB tensors with libjpeg-turbo (torchvision's or TorchCodec's
    decoder: jpeg_decoders.py), one call for the list, EXIF orientation applied; None where it
    fails (PIL then gets it and names the problem), or for every one where neither library
    decodes JPEGs."""
    decoder = jpeg_decoder()
    results: list[Optional[torch.Tensor]] = [None] * len(blobs)
    if decoder is None:
        return results
    # Over the pixel limit by its header: never handed to libjpeg, which would allocate the
    # whole image first (a 5 MB JPEG of 20000x20000 is 1.2 GB decoded); PIL's path names it.
    within = [i for i, blob in enumerate(blobs) if not _over_pixel_limit(blob)]
    if not within:
        return results
    tensors = [torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) for i in within]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # libjpeg's "corrupt data" warnings
        images = each_or_none(lambda data, turns: decoder.decode(data, _CPU, turns), tensors, None)
    for i, image in zip(within, images):
        # A header PIL could not read may hide a size the decoder found: checked again.
        if image is not None and image.shape[-1] * image.shape[-2] <= _pixel_limit():
            results[i] = image
    return results


def _pixel_limit() -> float:
    return Image.MAX_IMAGE_PIXELS or math.inf


def _over_pixel_limit(blob: bytes) -> bool:
    """Whether a file's header gives it more pixels than PIL's decompression-bomb limit; False
    where PIL cannot read the header (the decoder, then PIL, name what is wrong).  PIL's limit
    is left as it is (pil_size lifts it for a moment): this runs for every JPEG, and another
    thread's Image.open must not meet the limit lifted."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # counted below
            with Image.open(io.BytesIO(blob)) as pil:
                width, height = pil.size
    except Image.DecompressionBombError:  # twice the limit or more: PIL refuses to open it
        return True
    except Exception:  # noqa: BLE001 -- a broken header is named where it is decoded
        return False
    return width * height > _pixel_limit()


def _too_large(width: int, height: int) -> str:
    return (f"{width}x{height} = {width * height:,} pixels, over PIL's decompression-bomb limit "
            f"of {Image.MAX_IMAGE_PIXELS:,} (PIL.Image.MAX_IMAGE_PIXELS)")


# HEIF's brands (ISO/IEC 23008-12) naming HEVC-coded images: an iPhone's .HEIC photo, which PIL
# opens only with a plugin it does not ship; its first bytes in hex would not tell a user that
_HEIC_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs")


def _is_heic(head: bytes) -> bool:
    """Whether a file's first bytes are an ISO media file's `ftyp` box naming HEIC among its
    brands (the major brand at 8..12, the compatible ones after the version at 16..)."""
    if head[4:8] != b"ftyp":
        return False
    box = head[8:int.from_bytes(head[:4], "big")]
    brands = [box[:4]] + [box[i:i + 4] for i in range(8, len(box) - 3, 4)]
    return any(brand in _HEIC_BRANDS for brand in brands)


def _not_an_image(item) -> str:
    head = bytes(item[:64]) if isinstance(item, bytes) else b""
    if _is_heic(head):
        return ("a HEIC photo, a format PIL does not open (phones save photos in it): convert it "
                "to JPEG or PNG")
    try:  # incremental: a character cut by the 64-byte head is left out, not taken for binary
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        text = None
    if text is not None and text.strip() and all(c.isprintable() or c.isspace() for c in text):
        first = " ".join(text.split())[:30]
        return f"not an image: the file holds text ({first!r}...)"
    return f"not an image format PIL can read (first bytes {head[:8].hex()})"


def _describe(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    if "truncated" in text.lower():
        return f"truncated file ({text})"
    return text if isinstance(err, OSError) else f"{type(err).__name__}: {text}"
