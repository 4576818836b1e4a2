"""Weight files that users and runs hand us (`--pretrained`, a run's or export's
model.safetensors), read so that a file cut short or not what its name says is one line naming
it and what to do, not the reading library's traceback.  The reading itself is readers.py's."""

from __future__ import annotations

from pathlib import Path

import torch

from accel_train.base.errors import UsageError
from accel_train.base import readers
from accel_train.base.readers import CUT_SHORT, safetensors_shapes, torch_file_problem


def read_safetensors(path: Path, what: str, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a UsageError: `what` names it for the user (a flag
    or a run), `fix` says what to do."""
    return readers.read_safetensors(path, "run_weights", what, fix)


def check_weights_file(path: Path, what: str, fix: str) -> None:
    """Whether a weights file can be read at all, before a library that would fail with a
    traceback reads it: a safetensors header, or torch's zip archive whole to its directory (the
    end of the file; a legacy non-zip torch file is left to torch)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        safetensors_shapes(path, "pretrained", what, fix)
        return
    if torch_file_problem(path) == "is a torch file without its end":
        raise UsageError(f"{what}: {path} is a torch weights file without its end; {CUT_SHORT}: "
                         f"{fix}")
