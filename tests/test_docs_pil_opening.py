"""The lines docs/commands.md gives for opening an image as `accel-train predict` does, run as
a reader copies them: an image whose transparency is a colour of its own (a PNG's tRNS chunk on
an RGB or grey image, as many logo and screenshot tools write it) comes out over white, as
data.md says predict puts it.  Oracle: the pixels, with the transparent colour made white by
numpy."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

COMMANDS_MD = Path(__file__).resolve().parent.parent / "docs" / "commands.md"
KEY = (10, 20, 30)  # the transparent colour


def opening_lines() -> str:
    """The docs' block that opens a photo, without its last line (the model's)."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", COMMANDS_MD.read_text(), re.S)
                 if "exif_transpose" in b)
    return "\n".join(line for line in block.splitlines() if "probabilities" not in line)


def opened(path: Path) -> np.ndarray:
    scope: dict = {}
    exec(opening_lines().replace('"photo.jpg"', repr(str(path))), scope)  # noqa: S102
    return np.asarray(scope["image"].convert("RGB"))


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_the_documented_opening_puts_a_transparent_colour_on_white(tmp_path, mode):
    pixels = np.random.default_rng(0).integers(40, 256, (12, 16, 3), dtype=np.uint8)
    pixels[:4, :5] = KEY
    image = Image.fromarray(pixels).convert(mode)
    key = KEY if mode == "RGB" else int(np.asarray(image)[0, 0])
    image.save(tmp_path / "logo.png", transparency=key)
    expected = np.asarray(image.convert("RGB")).copy()
    values = np.asarray(image)
    expected[(values == key).all(-1) if mode == "RGB" else values == key] = 255
    assert np.array_equal(opened(tmp_path / "logo.png"), expected)
