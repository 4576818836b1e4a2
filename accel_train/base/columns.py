"""Text padded to a terminal column by the width it shows at, not its length: CJK characters
take two columns and combining accents none (Python's str.ljust counts characters, which left
a table of Japanese file or class names out of line)."""

from __future__ import annotations

import unicodedata


def display_width(text: str) -> int:
    return sum(0 if unicodedata.combining(char) else
               2 if unicodedata.east_asian_width(char) in ("W", "F") else 1 for char in text)


def pad(text: str, width: int) -> str:
    """`text` and the spaces that make it `width` columns wide (at least)."""
    return text + " " * max(0, width - display_width(text))
