"""The start's note that the training photos are far larger than training needs and decoded
whole at every step, with the command that stores them smaller once (`accel-train shard
--max-side`, streaming/max_side.py).

Why a note: a phone's 12-megapixel photo costs the loader path about 40 times a 512 px copy
of it (AMD EPYC, one core: benchmarks/bench_max_side.py), so a GPU fed from such a folder waits
on the cores whatever the model, and nothing else in the run says why."""

from __future__ import annotations

import statistics
from typing import Optional

STORED_SIDE = 512   # what --max-side suggests for training at up to 256 px
PIXELS_OVER = 16    # the note from 16 times the pixels of the stored copy (4x each side)


def suggested_side(image_size: int) -> int:
    """--max-side for training at `image_size`: 512 up to 256 px, else twice the size rounded
    up to 64 px (the training crop takes 8-100% of the image before its resize)."""
    return max(STORED_SIDE, -(-2 * image_size // 64) * 64)


def large_photo_note(shapes: list[tuple[int, int]], image_size: int,
                     source_flag: str) -> Optional[str]:
    """The note for images decoded per step whose probed (height, width) `shapes` have a
    median longer side at least 4 times `suggested_side`; None otherwise.  `source_flag`: the
    data as the shard command takes it (`--data-dir photos`)."""
    if not shapes:
        return None
    side = suggested_side(image_size)
    longer = statistics.median(max(shape) for shape in shapes)
    if longer * longer < PIXELS_OVER * side * side:
        return None
    height, width = min(shapes, key=lambda shape: abs(max(shape) - longer))
    return (f"the training images are large (a median longer side of {longer:.0f} px of "
            f"{len(shapes)} looked at, such as {width}x{height}) and decoded whole at every "
            f"step, for {image_size} px crops: `accel-train shard {source_flag} --output SHARDS "
            f"--max-side {side}` stores them at {side} px once, then train with --data-dir "
            f"SHARDS (docs/data.md, Large photos)")
