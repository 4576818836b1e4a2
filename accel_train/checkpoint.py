"""Checkpoints that survive being killed at any moment.

Layout: `<dir>/step_XXXXXXXX/` holding what `accelerator.save_state` writes (model as safetensors,
optimizer, scheduler, grad scaler, every rank's RNG state), our `trainer_state.json`, and
`manifest.json` with the SHA-256 of every file, written last.  A save goes to `.tmp-step_...`
and is renamed into place only once its manifest is written; older checkpoints are pruned only
after that.  A `.tmp-` folder whose manifest verifies is a finished save that was killed before
its rename: the next start completes the rename.  Any other `.tmp-` folder is discarded.

Loading verifies the manifest first and goes through Accelerate's `load`, which unpickles with
`weights_only=True`: a checkpoint cannot run code.  Nothing is registered with
`register_for_checkpointing` (Accelerate loads those objects with `weights_only=False`), and the
RNG file, which Accelerate would silently skip if it failed to load, is vetted here first.
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
from .testhooks import maybe_stall_save

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.json"
NAME_PATTERN = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
SUPERSEDED_PREFIX = "superseded-"
RNG_FILE = "random_states_{rank}.pkl"  # Accelerate's name for each rank's RNG state


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
    train_samples: int = 0        # N in the sampler's keys (epoch * N + index); 0: not recorded
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
    _fsync(directory)


def verify(directory: Path) -> Optional[str]:
    """None if the checkpoint is complete and untouched, else the reason it is not."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if STATE_FILE not in files:
        return f"{STATE_FILE} is not in the manifest"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum (truncated or modified)"
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


def recover_interrupted_saves(root: Path, warn: Callable[[str], None]) -> None:
    """Main process, before anything reads the folder: finish or discard what a killed save left.

    A save is complete once its manifest verifies; only the rename may be missing.
    """
    if not root.is_dir():
        return
    for tmp in sorted(root.glob(TMP_PREFIX + "*")):
        final = root / tmp.name[len(TMP_PREFIX):]
        if tmp.is_dir() and NAME_PATTERN.match(final.name) and not final.exists() \
                and verify(tmp) is None:
            os.replace(tmp, final)
            warn(f"completed the interrupted save of {final} (its manifest verifies)")
        elif tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    _fsync(root)


def set_aside_newer(root: Path, step: int, warn: Callable[[str], None]) -> None:
    """Main process, when resuming from `step`: checkpoints of later steps belong to a future
    that is about to be redone.  Left in place they would be taken by the next `--resume auto`
    (if valid) or outrank the new ones when pruning (if not); renamed, they are kept for
    inspection but never loaded or pruned."""
    for path in list_checkpoints(root):
        if int(NAME_PATTERN.match(path.name).group(1)) <= step:
            continue
        target = root / (SUPERSEDED_PREFIX + path.name)
        suffix = 1
        while target.exists():
            suffix += 1
            target = root / f"{SUPERSEDED_PREFIX}{path.name}.{suffix}"
        os.replace(path, target)
        warn(f"{path} is newer than the checkpoint resumed from: moved it to {target.name}")


def resolve_resume(root: Path, resume: str, warn: Callable[[str], None]) -> Optional[Path]:
    """'auto' -> newest valid checkpoint under root, or None; a path -> that checkpoint (or the
    newest valid one in that folder), verified, else a UsageError.  Main process only.
    Killed saves under root are finished or discarded first; never when the input is bad."""
    if resume == "auto":
        recover_interrupted_saves(root, warn)
        return find_latest_valid(root, warn)
    chosen = _resolve_path(resume, warn)
    recover_interrupted_saves(root, warn)
    return chosen


def _resolve_path(resume: str, warn: Callable[[str], None]) -> Path:
    path = Path(resume)
    if NAME_PATTERN.match(path.name) is None and list_checkpoints(path):
        latest = find_latest_valid(path, warn)  # a checkpoints folder was given
        if latest is None:
            raise UsageError(f"--resume {resume}: no valid checkpoint in that folder; pass "
                             f"another folder, or --resume auto to start over if none is left")
        return latest
    if not path.is_dir():
        raise UsageError(f"--resume {resume}: no such checkpoint folder; pass a step_XXXXXXXX "
                         f"folder, its parent, or 'auto'")
    problem = verify(path)
    if problem is not None:
        raise UsageError(f"--resume {resume}: checkpoint is not usable ({problem}); pass "
                         f"another one or --resume auto")
    return path


def accumulation_for(previous: TrainerState, batch_size: int, num_processes: int) -> int:
    """The accumulation steps that keep the checkpoint's global batch with this batch size and
    process count; a UsageError naming settings that would work when none does."""
    target = previous.global_batch
    per_step = batch_size * num_processes
    if target % per_step == 0:
        return target // per_step
    batch_options = []
    if target % num_processes == 0:
        per_proc = target // num_processes
        batch_options = [b for b in range(per_proc, 0, -1) if per_proc % b == 0][:4]
    proc_options = [p for p in range(1, target // batch_size + 1)
                    if target % (batch_size * p) == 0][-4:]
    hints = []
    if batch_options:
        hints.append(f"--batch-size {' or '.join(map(str, batch_options))} on {num_processes} "
                     f"process(es)")
    if proc_options:
        hints.append(f"{' or '.join(map(str, proc_options))} process(es) with --batch-size "
                     f"{batch_size}")
    hint = "; or ".join(hints) if hints else f"a batch size and process count dividing {target}"
    raise UsageError(
        f"the checkpoint was trained with a global batch of {target} ({previous.batch_size} x "
        f"{previous.world_size} process(es) x {previous.accumulation_steps} accumulation), which "
        f"--batch-size {batch_size} on {num_processes} process(es) cannot make with whole "
        f"accumulation steps; use {hint}")


def check_same_data_order(previous: TrainerState, seed: int, train_samples: int) -> None:
    """The epoch's order is a function of the seed and the training set: with either changed,
    skipping the samples already used would skip other ones, and some would be used twice."""
    if previous.seed != seed:
        raise UsageError(f"the checkpoint was trained with --seed {previous.seed}; resume with "
                         f"the same seed (got {seed}), or start a new run")
    if previous.train_samples and previous.train_samples != train_samples:
        raise UsageError(f"the checkpoint was trained on {previous.train_samples} training "
                         f"images but this start has {train_samples}; resume with the same data "
                         f"options (--max-train-samples, --val-fraction, ...), or start a new run")


class Checkpointer:
    """Saves and loads through the Accelerator; every rank calls save/load together."""

    def __init__(self, accelerator, root: Path, keep: int, warn: Callable[[str], None]):
        self.accelerator, self.root, self.keep, self.warn = accelerator, Path(root), keep, warn

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
            maybe_stall_save(state.step, self.warn)
            write_manifest(tmp, state)
            self._publish(tmp, final)
            self._prune()
        acc.wait_for_everyone()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename the finished save into place.  The same step may be saved twice (a pre-emption
        save at an epoch's last step, then the epoch-end save): the old one is moved aside, not
        deleted, until the new one is in place, so a kill in between loses nothing."""
        replaced = None
        if final.exists():
            replaced = self.root / f"{TMP_PREFIX}replaced-{final.name}"
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync(self.root)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest K complete checkpoints.  Each old one is renamed first and deleted
        after, so a kill mid-delete leaves a `.tmp-` folder, never a half-deleted checkpoint."""
        complete = [p for p in list_checkpoints(self.root) if (p / MANIFEST).is_file()]
        for old in complete[self.keep:]:
            doomed = self.root / f"{TMP_PREFIX}pruned-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, path: Path) -> TrainerState:
        """Load a checkpoint that `resolve_resume` verified; a UsageError if it holds anything
        but plain tensors."""
        self._vet_rng_file(path)
        try:
            self.accelerator.load_state(str(path))
        except pickle.UnpicklingError as err:
            raise UsageError(_refusal(path, err)) from None
        return read_state(path)

    def _vet_rng_file(self, path: Path) -> None:
        """Accelerate loads this rank's RNG state inside a try/except that ignores every error;
        load it here first so that a refused file is reported, not silently skipped."""
        from accelerate.utils import load  # weights_only=True plus numpy's safe globals

        rng_file = path / RNG_FILE.format(rank=self.accelerator.process_index)
        if not rng_file.is_file():
            self.warn(f"{path} has no RNG state for rank {self.accelerator.process_index} (it was "
                      f"written by {read_state(path).world_size} process(es)); this rank keeps "
                      f"its fresh RNG state (data order and augmentation do not depend on it)")
            return
        try:
            load(rng_file)
        except pickle.UnpicklingError as err:
            raise UsageError(_refusal(path, err)) from None


def _refusal(path: Path, err: Exception) -> str:
    first_line = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    return (f"checkpoint {path} holds a pickled object that is not plain tensors; refusing to "
            f"load it ({first_line})")


def check_fresh_checkpoint_dir(root: Path) -> None:
    """A new run must not write into (and prune) another run's checkpoints."""
    if list_checkpoints(root):
        raise UsageError(f"--checkpoint {root} already holds checkpoints of another run; pass "
                         f"--resume auto to continue it, or choose another --checkpoint folder")


# -- which elastic job a run directory belongs to ------------------------------------------------
JOB_ID_FILE = "elastic_run_id"  # the rendezvous id (--rdzv-id) of the job that started the run


def record_elastic_job(output_dir: Path, run_id: str) -> None:
    """Main process, once the run has started: remember which torchelastic job owns it."""
    if run_id not in ("", "none") and not (Path(output_dir) / JOB_ID_FILE).exists():
        (Path(output_dir) / JOB_ID_FILE).write_text(run_id + "\n")


def started_by_elastic_job(output_dir: Optional[str], run_id: str) -> bool:
    """True when `output_dir` holds a run started by the torchelastic job `run_id`: a new round
    of that job (after a membership change the agents restart workers without counting a
    restart, and a machine that joins later counts from 0) must continue it, not refuse it."""
    if not output_dir or run_id in ("", "none"):
        return False
    marker = Path(output_dir) / JOB_ID_FILE
    return marker.is_file() and marker.read_text().strip() == run_id
