"""Checkpoints that survive being killed at any moment.

Layout: `<dir>/step_XXXXXXXX/` holding what `accelerator.save_state` writes (model as safetensors,
optimizer, scheduler, grad scaler, every rank's RNG state), our `trainer_state.json`, and
`manifest.json` with the SHA-256 of every file, written last.  A save goes to `.tmp-step_...`
and is renamed into place only when complete; older checkpoints are pruned only after that.
Loading verifies the manifest first and goes through Accelerate's `load`, which unpickles with
`weights_only=True`: a checkpoint cannot run code (nothing is registered with
`register_for_checkpointing`, whose objects Accelerate loads with `weights_only=False`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from .errors import UsageError

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.json"
NAME_PATTERN = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"


@dataclass
class TrainerState:
    """Where the run is: enough to continue it exactly, or on another number of processes."""

    step: int = 0                 # optimizer steps taken
    epoch: int = 0                # current epoch (0-based)
    samples_in_epoch: int = 0     # samples of this epoch already consumed, all processes together
    samples_seen: int = 0
    world_size: int = 1
    batch_size: int = 0           # per process
    accumulation_steps: int = 1
    seed: int = 0
    best_top1: Optional[float] = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accumulation_steps

    def to_json(self) -> dict:
        return {**asdict(self), "global_batch": self.global_batch}

    @classmethod
    def from_json(cls, data: dict) -> "TrainerState":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, state: TrainerState) -> None:
    """Write trainer_state.json, fsync everything, then the manifest (last, atomically)."""
    (directory / STATE_FILE).write_text(json.dumps(state.to_json(), indent=2) + "\n")
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[str(path.relative_to(directory))] = {"sha256": _sha256(path),
                                                   "bytes": path.stat().st_size}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": state.step, "files": files}, indent=2) + "\n")
    _fsync(tmp)
    os.replace(tmp, directory / MANIFEST)


def verify(directory: Path) -> Optional[str]:
    """None if the checkpoint is complete and untouched, else the reason it is not."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum (truncated or modified)"
    if STATE_FILE not in files:
        return f"{STATE_FILE} is missing"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under root, newest (highest step) first, found by parsing names."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := NAME_PATTERN.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_latest_valid(root: Path, warn: Callable[[str], None]) -> Optional[Path]:
    for path in list_checkpoints(root):
        problem = verify(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None


def read_state(directory: Path) -> TrainerState:
    return TrainerState.from_json(json.loads((directory / STATE_FILE).read_text()))


class Checkpointer:
    """Saves and loads through the Accelerator; every rank calls save/load together."""

    def __init__(self, accelerator, root: Path, keep: int, warn: Callable[[str], None]):
        self.accelerator, self.root, self.keep, self.warn = accelerator, Path(root), keep, warn

    def clean_stale_temporaries(self) -> None:
        """Half-written saves from a killed run are never valid; remove them (main process)."""
        if self.accelerator.is_main_process and self.root.is_dir():
            for path in self.root.glob(TMP_PREFIX + "*"):
                shutil.rmtree(path, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def save(self, state: TrainerState) -> Path:
        acc = self.accelerator
        final = self.root / checkpoint_name(state.step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()  # every rank's RNG file is on disk before the manifest
        if acc.is_main_process:
            write_manifest(tmp, state)
            if final.exists():  # the same step saved before (e.g. a pre-emption save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(self.root)
            self._prune()
        acc.wait_for_everyone()
        return final

    def _prune(self) -> None:
        valid = [p for p in list_checkpoints(self.root) if (p / MANIFEST).is_file()]
        for old in valid[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def resolve(self, resume: str) -> Optional[Path]:
        """'auto' -> newest valid checkpoint or None; a path -> that checkpoint, verified."""
        if resume == "auto":
            return find_latest_valid(self.root, self.warn)
        path = Path(resume)
        if NAME_PATTERN.match(path.name) is None and list_checkpoints(path):
            latest = find_latest_valid(path, self.warn)  # a checkpoints folder was given
            if latest is None:
                raise UsageError(f"--resume {resume}: no valid checkpoint in that folder")
            return latest
        if not path.is_dir():
            raise UsageError(f"--resume {resume}: no such checkpoint folder; pass a step_XXXXXXXX "
                             f"folder, its parent, or 'auto'")
        problem = verify(path)
        if problem is not None:
            raise UsageError(f"--resume {resume}: checkpoint is not usable ({problem}); pass "
                             f"another one or --resume auto")
        return path

    def load(self, path: Path) -> TrainerState:
        try:
            self.accelerator.load_state(str(path))
        except pickle.UnpicklingError as err:
            raise UsageError(f"checkpoint {path} holds a pickled object that is not plain tensors "
                             f"({str(err).splitlines()[0][:120]}); refusing to load it") from None
        return read_state(path)
