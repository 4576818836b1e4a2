"""The command a run records (config.yaml, config.json, the model card): what the user ran.
The entry point that parsed it says so: `accel-train` and `python -m accel_train` ran the
process's own argv, `cli.main(ARGS)` called from a program ran `accel-train ARGS`, and a
program calling fit() ran itself (its argv).  Below the entry points nothing reads sys.argv:
it is the caller's, not the run's, where the command line is called from Python."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_command: Optional[list[str]] = None


def set_command(words: Sequence[str]) -> None:
    global _command
    _command = [str(word) for word in words]


def recorded_command() -> list[str]:
    """The command set by the entry point; the process's argv where none set one."""
    return list(_command) if _command is not None else list(sys.argv)
