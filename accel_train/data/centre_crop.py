"""timm's held-out centre crop (crop_mode "center") of a very long, thin image, resampling only
the region the crop keeps.

timm's eval transform resizes the shorter side to size / crop_pct (torchvision's Resize of an
int) and then takes the centre crop: a 1 x 4000 strip becomes 256 x 1,024,000 pixels on the way
to a 224 x 224 crop, about 786 MB held at once (a process's peak memory grew by 1,043 MiB on
it), for a crop that needs 224 x 224 x 3 bytes.  PIL's `Image.resize` takes a `box`, the source
region to resample: given the crop's region in source coordinates (the same scale, shifted by
the crop's offset), each output pixel's filter is centred where the full resize centres it, so
the crop comes out as it would have, at the cost of the crop alone (the same strip: +0 MiB,
1.77 s down to 0.00 s; `predict` of a 1 x 20000 strip at 96 px peaked at 1,743 MiB against
886 MiB for a 100 x 100 photo, and now at 886 MiB for both: tests/test_long_thin_images.py).

Not bit-identical, so only beyond EXACT_ASPECT: PIL takes the box as float32 and derives each
centre as box start + (i + 0.5) x scale, not as (offset + i + 0.5) x scale, so a filter weight
may round to another fixed-point value; measured against timm's transform over 15 shapes (1 x
4000 to 5000 x 200), bilinear, bicubic, hamming and lanczos, 4 crop_pcts: at most 1 level in 255,
in 0.015% of the pixels (tests/test_long_thin_images.py bounds it at 1 level in under 1%); on
a pixel-wide checkerboard, where every shifted weight moves a pixel most, 1 level in up to 1.04%
of them (30 x 2000, bicubic; 17 x 900 lanczos: none).  The
source is cut to the region (with its filter's reach) first, so that the box's coordinates are
small and float32 holds them to far less than a pixel, however long the strip.  Only where the
shorter side is enlarged: a shrink's resized image holds fewer pixels than the decoded one, so
it costs nothing new (and PIL orders a shrink's two passes by rules of its own).
"""

from __future__ import annotations

import math
from typing import Optional

from PIL import Image

# Up to this ratio of the longer side to the shorter an image takes timm's own transform, bit
# for bit (exports promise timm's numbers): its resized image is then at most 4 crops' worth of
# pixels (0.8 MB at 224 px, crop_pct 0.875), no more than the decoded photograph itself.  Beyond
# it, ever larger for nothing (at 8:1, 1.6 MB; at 4000:1, 786 MB), the region alone.
EXACT_ASPECT = 4

# The widest filter PIL resizes with, in output pixels (Lanczos: 3): how far beyond the crop's
# region the source pixels it weighs may lie, times the source pixels per output pixel.
_WIDEST_SUPPORT = 3
_SMOOTH_FILTERS = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC,
                   Image.Resampling.HAMMING, Image.Resampling.LANCZOS)


def long_thin_centre_crop(pil: Image.Image, size: int, crop_pct: float,
                          resample: int) -> Optional[Image.Image]:
    """The size x size crop timm's eval transform (crop_mode "center", `crop_pct`, PIL filter
    `resample`) makes of `pil`, resampled from the region it keeps; None where timm's own
    transform should run: an aspect within EXACT_ASPECT, a shorter side at or above size /
    crop_pct (a shrink: the resized image holds fewer pixels than the decoded one, and PIL
    orders a shrink's two passes by rules of its own), a crop_pct above 1 (the crop pads), or a
    filter of steps (nearest, box), which a shift of a centre by float32's last digit moves to
    the next source pixel."""
    if resample not in _SMOOTH_FILTERS:
        return None
    width, height = pil.size
    short, long = sorted((width, height))
    scale_size = math.floor(size / crop_pct)  # timm's transforms_imagenet_eval
    if long <= EXACT_ASPECT * short or short >= scale_size or scale_size < size:
        return None
    new_long = int(scale_size * long / short)  # torchvision's _compute_resized_output_size
    new_w, new_h = (scale_size, new_long) if width <= height else (new_long, scale_size)
    # torchvision's center_crop offsets in the resized image, then both axes in source pixels
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    x0, x1, cut_x0, cut_x1 = _region(left, size, width / new_w, width)
    y0, y1, cut_y0, cut_y1 = _region(top, size, height / new_h, height)
    region = pil.crop((cut_x0, cut_y0, cut_x1, cut_y1))
    # The width's pass, then the height's, each a resize of one axis (PIL skips the other), each
    # rounded to 8 bits: the order and rounding of PIL's enlargement of the whole image.  One
    # call with both would let PIL pick the order for the cut region's sizes (Pillow 13 passes
    # the height first where it shrinks more than the width by its rules), which can differ.
    across = region.resize((size, region.height), resample,
                           box=(x0 - cut_x0, 0, x1 - cut_x0, region.height))
    return across.resize((size, size), resample, box=(0, y0 - cut_y0, size, y1 - cut_y0))


def _region(offset: int, size: int, scale: float, length: int) -> tuple[float, float, int, int]:
    """Along one axis: the crop's source span [start, end) (output pixels offset..offset+size at
    `scale` source pixels each) and the whole source pixels [cut_start, cut_end) its filters
    reach, within the axis's `length`."""
    start, end = offset * scale, (offset + size) * scale
    reach = _WIDEST_SUPPORT * max(scale, 1.0) + 1
    return start, end, max(0, math.floor(start - reach)), min(length, math.ceil(end + reach))
