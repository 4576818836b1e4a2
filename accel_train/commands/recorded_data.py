"""What an export folder says its model was trained on, for `eval`'s request for data.

An export (accel-train export) carries no run config.yaml, only the training command in its
config.json's accel_train section.  That command's --data-dir is as typed: relative to the
folder training ran in, which is not this one, so eval never reads it by itself; it names it,
so that the user knows which data to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from accel_train.model.saved import read_our_section

# the spellings the training command line takes (cli.py: both, never abbreviated)
_FLAGS = {"--data-dir": "--data-dir", "--data_dir": "--data-dir", "--dataset": "--dataset"}


def recorded_data(command: Sequence[str]) -> Optional[tuple[str, str]]:
    """(flag, value) of the data a training command names, --data-dir before --dataset; None
    where it names neither (a --config file's data, a program's fit())."""
    found: dict[str, str] = {}
    for i, word in enumerate(command):
        name, _, value = word.partition("=")
        if name in _FLAGS and not value and i + 1 < len(command):
            value = command[i + 1]
        if name in _FLAGS and value:
            found.setdefault(_FLAGS[name], value)
    for flag in ("--data-dir", "--dataset"):
        if flag in found:
            return flag, found[flag]
    return None


def data_hint(folder: Path) -> Optional[str]:
    """What to pass, naming the data the training command in `folder`'s config.json gave; None
    where it names none."""
    data = recorded_data(read_our_section(folder).get("command") or [])
    if data is None:
        return None
    flag, value = data
    if flag == "--dataset":
        return f"pass --data-dir PATH or --dataset NAME: it was trained on --dataset {value}"
    path = Path(value)
    if not path.is_absolute():
        return (f"pass --data-dir PATH: it was trained on --data-dir {value} (relative to the "
                f"folder training ran in)")
    where = "which is there: pass it" if path.exists() else "which is not there from here"
    return f"pass --data-dir PATH: it was trained on --data-dir {value}, {where}"
