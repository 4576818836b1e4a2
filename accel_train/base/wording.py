"""Which words a run's console lines name its options in.  The product's messages are written
for the command line (`--resume auto`, `--no-plots`); a program that called fit() wrote keyword
arguments (`resume='auto'`, `plots=False`), and reads its warnings and summary in those.  The
entry point says which (as it says which command ran: command.py), for the length of its run;
nothing below it knows who called."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

_translate: Optional[Callable[[str], str]] = None


@contextmanager
def spoken_as(translate: Callable[[str], str]) -> Iterator[None]:
    """Within the block, console lines pass through `translate` (the one before comes back
    after: a run's callback may run another)."""
    global _translate
    before, _translate = _translate, translate
    try:
        yield
    finally:
        _translate = before


def in_callers_words(text: str) -> str:
    return _translate(text) if _translate is not None else text
