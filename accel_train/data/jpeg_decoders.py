"""JPEG bytes -> uint8 [3, H, W] RGB tensors, a list in one call, on the CPU (libjpeg-turbo) or
on a CUDA device (nvJPEG): torchvision's decoder while torchvision has one, else TorchCodec's.

torchvision deprecates its image decoders from 0.29 in favour of TorchCodec's (from 0.16), which
decode the same way (on the CPU to the same pixels: tests/test_jpeg_decoders.py).  torchvision's
stays first while it exists because it is the one measured on GPUs (BENCHMARKS.md).  TorchCodec
is an optional extra (`accel_train[torchcodec]`), not a dependency: its wheels do not name the
torch they were built for, and one built for another torch fails at import, which here counts
as not installed (`missing()` then says what failed).

Both give each image turned as its EXIF orientation says, as PIL's exif_transpose does:
TorchCodec always reads it and turns the image itself, on either device; torchvision's CUDA
call takes no such argument, so `orient` turns its images here, by the orientations the caller
read (the device path's workers have them from the headers) or PIL's reading of each header.
Both raise RuntimeError (or ValueError) on a file they cannot decode, and refuse the whole list
for it: `each_or_none` then finds the bad file, which the callers hand to PIL (decode.py) or the
host path (device_decode.py).
"""

from __future__ import annotations

import functools
import io
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from PIL import ExifTags, Image

_ORIENTATION = ExifTags.Base.Orientation
DECODE_ERRORS = (RuntimeError, ValueError)  # what both libraries raise for a file they refuse

# torchvision's decoders warn at every call that they are deprecated for TorchCodec's (they
# still work).  Only that message, once for the process, not a filter set around each call:
# the device path decodes on a thread of its own (decode_ahead.py), and catch_warnings saves and
# restores the process's one list of filters, which undid, under the training thread, whatever
# that thread set meanwhile (tests/test_jpeg_decoders.py).
warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision "
                        "are deprecated", DeprecationWarning)


@dataclass(frozen=True)
class JpegDecoder:
    library: str  # "torchvision" or "torchcodec": for messages
    # (blobs, device, orientations): each blob a 1-D uint8 CPU tensor of a file's bytes; the
    # files' EXIF orientations where the caller has read them already, else None (TorchCodec
    # reads its own either way)
    decode: Callable[[list[torch.Tensor], torch.device, Optional[list[int]]],
                     list[torch.Tensor]]


def jpeg_decoder() -> Optional[JpegDecoder]:
    """The decoder this environment has, or None (`missing()` says why)."""
    return _found()[0]


def missing() -> str:
    """Why there is no decoder (empty when there is one), as a user reads it."""
    return _found()[1]


@functools.cache
def _found() -> tuple[Optional[JpegDecoder], str]:
    decoder = _torchvision()
    if decoder is not None:
        return decoder, ""
    try:
        return _torchcodec(), ""
    except ImportError:
        problem = "TorchCodec is not installed"
    except Exception as err:  # noqa: BLE001 -- a wheel built for another torch fails to load
        problem = f"TorchCodec did not load ({type(err).__name__}: {str(err)[:200]})"
    return None, (f"this torchvision has no JPEG decoder (TorchCodec's replaces it) and "
                  f"{problem}: pip install torchcodec")


def _torchvision() -> Optional[JpegDecoder]:
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None

    def decode(blobs: list[torch.Tensor], device: torch.device,
               orientations: Optional[list[int]]) -> list[torch.Tensor]:
        if orientations is None and device.type == "cpu":
            return list(decode_jpeg(blobs, mode=ImageReadMode.RGB, apply_exif_orientation=True))
        # Turned here where the caller has the orientations (the device path, on either
        # device, the same code on a CPU as on a GPU) and on CUDA, whose call takes no
        # apply_exif_orientation.
        images = list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device))
        if orientations is None:
            orientations = [exif_orientation(blob.numpy().tobytes()) for blob in blobs]
        return [orient(image, turn) for image, turn in zip(images, orientations)]

    return JpegDecoder("torchvision", decode)


def _torchcodec() -> JpegDecoder:
    from torchcodec.decoders import decode_jpeg

    def decode(blobs: list[torch.Tensor], device: torch.device,
               orientations: Optional[list[int]]) -> list[torch.Tensor]:
        return list(decode_jpeg(blobs, mode="RGB", device=device))  # (oriented)

    return JpegDecoder("torchcodec", decode)


Decode = Callable[[list[torch.Tensor], Optional[list[int]]], list[torch.Tensor]]


def each_or_none(decode: Decode, blobs: list[torch.Tensor],
                 orientations: Optional[list[int]]) -> list[Optional[torch.Tensor]]:
    """`decode(blobs, orientations)` in one call; when the decoder refuses the list, each file
    alone, None for each it refuses."""
    try:
        return list(decode(blobs, orientations))
    except DECODE_ERRORS:
        if len(blobs) == 1:
            return [None]
    turns = orientations or [None] * len(blobs)
    return [each_or_none(decode, [blob], None if turn is None else [turn])[0]
            for blob, turn in zip(blobs, turns)]


def exif_orientation(blob: bytes) -> int:
    """A file's EXIF orientation (1-8) as PIL reads it; 1 where it has none or PIL cannot
    read its header (the image is then taken as it is stored)."""
    try:
        with Image.open(io.BytesIO(blob)) as pil:
            return pil_orientation(pil)
    except Exception:  # noqa: BLE001 -- a broken header: the decoder names the problem
        return 1


def pil_orientation(pil: Image.Image) -> int:
    """An opened image's EXIF orientation, 1-8 (1 for a value exif_transpose ignores)."""
    orientation = pil.getexif().get(_ORIENTATION, 1)
    return orientation if orientation in range(1, 9) else 1


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A decoded [3, H, W] image as its EXIF orientation says it is seen: PIL's exif_transpose
    (2 mirror, 3 half turn, 4 upside down, 5 transpose, 6 a quarter turn clockwise, 7
    transverse, 8 a quarter turn anticlockwise)."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1).flip(-2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return image.transpose(-1, -2).flip(-1)
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return image.transpose(-1, -2).flip(-2)
    return image
