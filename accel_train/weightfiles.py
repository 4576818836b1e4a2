"""Weight files that users and runs hand us (`--pretrained`, a run's or export's
model.safetensors), read so that a file cut short or not what its name says is one line naming
it and what to do, not the reading library's traceback."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

from .errors import UsageError, first_line

CUT_SHORT = "it may be cut short (an interrupted download, copy or write)"


def read_safetensors(path: Path, what: str, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a UsageError: `what` names it for the user (a flag
    or a run), `fix` says what to do."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise UsageError(f"{what}: {path} is not a readable safetensors file "
                         f"({first_line(err)}); {CUT_SHORT}: {fix}") from None


def check_weights_file(path: Path, what: str, fix: str) -> None:
    """Whether a weights file can be read at all, before a library that would fail with a
    traceback reads it: a safetensors header, or torch's zip archive whole to its directory (the
    end of the file; a legacy non-zip torch file is left to torch)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as err:
            raise UsageError(f"{what}: {path} is not a readable safetensors file "
                             f"({first_line(err)}); {CUT_SHORT}: {fix}") from None
        return
    with open(path, "rb") as handle:
        starts_as_zip = handle.read(4) == b"PK\x03\x04"
    if starts_as_zip and not zipfile.is_zipfile(path):
        raise UsageError(f"{what}: {path} is a torch weights file without its end; {CUT_SHORT}: "
                         f"{fix}")
