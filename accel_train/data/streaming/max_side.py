"""`accel-train shard --max-side N`: images whose longer side exceeds N pixels stored at N, once,
instead of decoded at full size at every step.

Why: a phone's 12-megapixel JPEG takes a CPU core about 53 ms to decode (AMD EPYC, torchvision's
libjpeg-turbo decoder), nearly forty times an ImageNet-sized photo's 1.4 ms, and the training
crop is then resized from millions of pixels to 224 px: 202 ms a photo through the loader path
against 5 ms for the same photo stored at 512 px (benchmarks/bench_max_side.py).  Decoding
once at shard time is what FFCV's `max_resolution` and img2dataset's `--image_size` do for the
same reason.

The stored image is the one training would decode (EXIF orientation applied, transparency over
white, 16-bit scaled: decode.decode), resized with PIL's Lanczos filter to a longer side of N,
the aspect kept (the shorter side rounded), and saved as a JPEG at quality 95 where the file was
a JPEG, else as a PNG (lossless stays lossless).  A JPEG is decoded at a reduced scale first
(libjpeg's DCT scaling, PIL's draft, as PIL's own `thumbnail` does) where that still leaves at
least twice the pixels asked for on each side: the resize then filters what the reduction left.
Files within N, and files whose header cannot be read (training names them), are kept as they
are, byte for byte.
"""

from __future__ import annotations

import io
import warnings
from typing import Optional

from PIL import Image

from accel_train.base.errors import UsageError
from accel_train.data.decode import Unreadable, decode
from accel_train.data.jpeg_decoders import pil_orientation

JPEG_QUALITY = 95
DRAFT_MARGIN = 2  # the reduced decode keeps at least twice the target on each side


def check_max_side(max_side: Optional[int]) -> Optional[int]:
    if max_side is not None and max_side < 16:
        raise UsageError(f"--max-side is the longest side in pixels to store, >= 16 (got "
                         f"{max_side}); e.g. 512 for training at 224 px")
    return max_side


def target_size(width: int, height: int, max_side: int) -> Optional[tuple[int, int]]:
    """(width, height) within `max_side`, the aspect kept, or None where the image fits."""
    longer = max(width, height)
    if longer <= max_side:
        return None
    scale = max_side / longer
    return ((max_side, max(1, round(height * scale))) if width >= height
            else (max(1, round(width * scale)), max_side))


def within_max_side(data: bytes, ext: str, max_side: int) -> tuple[bytes, str, bool]:
    """(bytes, extension, whether resized): the file itself where it fits within `max_side`
    (or cannot be read), else its pixels at that size, encoded anew."""
    try:
        with warnings.catch_warnings():  # a photo over PIL's pixel limit: the draft reduces it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(data))
        width, height = pil.size
        if pil_orientation(pil) in (5, 6, 7, 8):  # a quarter turn: the sides as shown swap
            width, height = height, width
    except Exception:  # noqa: BLE001 -- a broken file is training's to name, as without the flag
        return data, ext, False
    size = target_size(width, height, max_side)
    if size is None:
        return data, ext, False
    is_jpeg = pil.format == "JPEG"
    if is_jpeg:
        # (in the file's own orientation: draft works before the EXIF turn)
        stored = size if pil.size == (width, height) else size[::-1]
        pil.draft(pil.mode, tuple(DRAFT_MARGIN * side for side in stored))
    try:
        pixels = decode(pil).permute(1, 2, 0).numpy()
    except Unreadable:
        return data, ext, False
    resized = Image.fromarray(pixels, "RGB").resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    if is_jpeg:
        resized.save(buffer, format="JPEG", quality=JPEG_QUALITY)
        return buffer.getvalue(), "jpg", True
    resized.save(buffer, format="PNG")
    return buffer.getvalue(), "png", True
