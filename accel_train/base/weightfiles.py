"""Weight files that users and runs hand us (`--pretrained`, a run's or export's
model.safetensors), read so that a file cut short or not what its name says is one line naming
it and what to do, not the reading library's traceback.  The reading itself is readers.py's;
the writing of every safetensors file the product makes is here (`write_safetensors`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

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


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                      metadata: Optional[dict[str, str]] = None) -> None:
    """safetensors' save_file, the file then readable as every other file a run writes: the
    library creates it mode 0600 (seen with safetensors 0.8), so an export meant to be shared,
    or a run on shared storage, was the writer's alone."""
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata=metadata)
    with_the_umask(path)


def with_the_umask(path: Path) -> None:
    """A file safetensors wrote (ours, or Accelerate's save_state's) given the mode every other
    file gets."""
    os.chmod(path, 0o666 & ~process_umask())


def process_umask() -> int:
    """The umask files are created with: Linux says it in /proc/self/status; elsewhere it is
    read by setting it (os.umask has no read-only form) and putting it straight back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
