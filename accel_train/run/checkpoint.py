"""Checkpoints that survive being killed at any moment, and the one owner of what a run resumes
from.

Everything a resumed run needs is a *checkpointed part* (`Checkpointed`: a name, `save(folder)`,
`load(folder)`; plain JSON or safetensors, never pickle): Accelerate's state (model, optimizer,
scheduler, grad scaler, every rank's RNG state), the trainer state, the train loader's position,
the schedule, the model spec, the EMA weights, the bad-image list.  The trainer hands the
`Checkpointer` its list of parts once; a save writes every part before the manifest seals the
folder, a resume restores every part in one call.  Adding state to a run is one entry in that
list (a test saves, restores into a fresh run and saves again: every file must come back the
same).

Layout: `<dir>/step_XXXXXXXX/` holding the parts' files and `manifest.json` with the checkpoint
format and the SHA-256 of every file, written last.  A save goes to `.tmp-step_...`
and is renamed into place only once its manifest is written; older checkpoints are pruned only
after that.  A `.tmp-` folder whose manifest verifies is a finished save that was killed before
its rename: the next start completes the rename.  Any other `.tmp-` folder is discarded.

Loading verifies the manifest first and goes through Accelerate's `load`, which unpickles with
`weights_only=True`: a checkpoint cannot run code.  Nothing is registered with
`register_for_checkpointing` (Accelerate loads those objects with `weights_only=False`), and the
RNG file, which Accelerate would silently skip if it failed to load, is vetted here first.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

from accel_train.base.errors import DISK_FULL_EXIT, RunDiffers, RunStopped, UsageError, first_line
from accel_train.base.readers import BadFile, Shape, check_fits, check_torch_file, read_json
from accel_train.base.weightfiles import with_the_umask
from accel_train.run.save_finishing import BackgroundSealing
from accel_train.run.trainer_state import STATE_FILE, TrainerState, read_state
from accel_train.train.selection import rank

if TYPE_CHECKING:
    from torch import nn

MANIFEST = "manifest.json"
NAME_PATTERN = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
SUPERSEDED_PREFIX = "superseded-"
RNG_FILE = "random_states_{rank}.pkl"  # Accelerate's name for each rank's RNG state
# The layout of a checkpoint's parts.  2: every part saved by the Checkpointer (loader.json or
# stream.json, schedule.json, bad_images.json); 1 (no "format" in the manifest): before that.
FORMAT = 2


class Checkpointed(Protocol):
    """A part of a run's state that every checkpoint holds.  `save` runs on the main process
    (on every rank together when `collective` is True), `load` on every rank."""

    name: str

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(path: Path) -> int:
    """Space left to this user on `path`'s filesystem."""
    return shutil.disk_usage(path).free


def out_of_space(err: BaseException, folder: Path) -> bool:
    """Whether a checkpoint write failed for want of space (a full disk, or over quota).
    Python's own writes raise OSError(ENOSPC or EDQUOT); safetensors raises its own error
    type that keeps only the OS's text; torch.save's C++ writer says only "unexpected pos", so
    for an error without either the filesystem is asked whether it is (nearly) full."""
    seen: set[int] = set()
    link: Optional[BaseException] = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in SPACE_ERRNOS:
            return True
        if any(os.strerror(number) in str(link) for number in SPACE_ERRNOS):
            return True
        link = link.__cause__ or link.__context__
    try:
        return free_bytes(folder) < NEARLY_FULL_BYTES
    except OSError:
        return False


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) \
        if folder.is_dir() else 0


def _newest_file(folder: Path) -> Optional[Path]:
    """The file written last: the one being written when a save failed."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None


def _size(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} bytes"  # not reached


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


def write_manifest(directory: Path, step: int) -> None:
    """Fsync every file of the folder, then write the manifest (last, atomically)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[str(path.relative_to(directory))] = {"sha256": _sha256(path),
                                                   "bytes": path.stat().st_size}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=2) + "\n")
    _fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)


def verify(directory: Path) -> Optional[str]:
    """None if the checkpoint is complete and untouched, else the reason it is not."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save never finished)"
    try:
        files = read_json(manifest_path, "manifest")["files"]
    except BadFile as err:
        return f"unreadable manifest ({err.problem})"
    for name, expected in files.items():
        problem = FILE_ENTRY.problem(expected)
        if problem is not None:
            return f"unreadable manifest (its entry for {name} {problem})"
    if STATE_FILE not in files:
        return f"{STATE_FILE} is not in the manifest"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum (truncated or modified)"
    return None


# A manifest's record of one file.
FILE_ENTRY = Shape({"sha256": str, "bytes": int})


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


def check_format(directory: Path) -> None:
    """A UsageError when a (verified) checkpoint was written in another format: resuming must
    neither misread it nor pass it over for an older one, or silently start from scratch."""
    found = read_json(directory / MANIFEST, "manifest").get("format", 1)
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT:
        raise UsageError(f"checkpoint {directory} is in checkpoint format {found}, written by a "
                         f"newer accel_train than this one (which reads format {FORMAT}); "
                         f"upgrade accel_train to resume it")
    if found != FORMAT:
        raise UsageError(f"checkpoint {directory} is in checkpoint format {found}, which this "
                         f"version of accel_train does not resume (it writes format {FORMAT}); "
                         f"resume it with the version that wrote it, or start a new run in "
                         f"another --output-dir")


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


class AccelerateState:
    """Accelerate's part of a checkpoint: the prepared model (safetensors), optimizer, scheduler,
    grad scaler and every rank's RNG state, through `save_state`/`load_state` (every rank).

    Loading goes through Accelerate's `load`, which unpickles with `weights_only=True`; the RNG
    file, which Accelerate would silently skip if it failed to load, is vetted here first.
    Exactness does not depend on the RNG files (randomness.py), but a refused file is still
    reported, never skipped."""

    name = "accelerate"
    collective = True

    def __init__(self, accelerator, warn: Callable[[str], None], models: Sequence[nn.Module]):
        """`models`: the modules the run passed through `accelerator.prepare`, bare (without
        DDP's or torch.compile's wrapper: save_state writes their own parameter names), in
        that order (the order it numbers their weight files in)."""
        self.accelerator, self.warn, self.models = accelerator, warn, tuple(models)

    def save(self, folder: Path) -> None:
        self.accelerator.save_state(str(folder), safe_serialization=True)
        if self.accelerator.is_main_process:  # the rank that wrote the model's weights
            for path in Path(folder).glob("*.safetensors"):
                with_the_umask(path)

    def load(self, folder: Path) -> None:
        from accelerate.utils.constants import SCALER_NAME

        self._vet_files(Path(folder))
        self._vet_rng_file(folder)
        scaler = self.accelerator.scaler
        if scaler is not None and not (Path(folder) / SCALER_NAME).is_file():
            # Written without a loss scaler (fp32, bf16, or on a CPU) and resumed in fp16 (what
            # auto becomes on CUDA): Accelerate would load scaler.pt whenever a scaler exists,
            # and fail.  The scaler starts afresh instead; it finds its scale in a few steps.
            self.accelerator.scaler = None
        try:
            self.accelerator.load_state(str(folder))
        except pickle.UnpicklingError as err:
            raise UsageError(_refusal(folder, err)) from None
        except ValueError as err:
            if "parameter group" not in str(err):  # torch's words for another grouping
                raise
            raise RunDiffers(f"checkpoint {folder} holds the optimizer state of other parameter "
                             f"groups than this start builds ({first_line(err)}): resume with "
                             f"the --freeze-backbone, --layer-decay, --decay-norm-and-bias and "
                             f"--norm-bias-lr-scale the run started with, or start a new "
                             f"run") from None
        finally:
            self.accelerator.scaler = scaler
        # Accelerate counts micro-steps to know when to sync; a resume is always at an
        # optimizer step boundary, and the accumulation count may have changed with the layout.
        self.accelerator.step = 0

    def _vet_files(self, folder: Path) -> None:
        """This part's own check of its content (the manifest vouches only for the bytes): each
        model file holds this model's tensors, each torch file is a whole one.  Accelerate and
        torch would otherwise fail deep inside, or load another model's tensors by name."""
        from accelerate.utils.constants import SAFE_WEIGHTS_NAME

        for index, model in enumerate(self.models):
            stem, suffix = SAFE_WEIGHTS_NAME.rsplit(".", 1)
            name = SAFE_WEIGHTS_NAME if index == 0 else f"{stem}_{index}.{suffix}"
            if (folder / name).is_file():
                check_fits(folder / name, "checkpoint_weights",
                           {k: tuple(v.shape) for k, v in model.state_dict().items()})
        for path in sorted(folder.iterdir()):
            if path.suffix in (".bin", ".pt", ".pkl"):
                check_torch_file(path, "accelerate_state")

    def _vet_rng_file(self, path: Path) -> None:
        from accelerate.utils import load  # weights_only=True plus numpy's safe globals

        rng_file = path / RNG_FILE.format(rank=self.accelerator.process_index)
        if not rng_file.is_file():
            self.warn(f"{path} has no RNG state for rank {self.accelerator.process_index} (it was "
                      f"written by {read_state(path).world_size} process(es)); this rank keeps "
                      f"its fresh RNG state (every random draw of training is seeded by its "
                      f"place in the run)")
            return
        try:
            load(rng_file)
        except pickle.UnpicklingError as err:
            raise UsageError(_refusal(path, err)) from None


class Checkpointer:
    """Saves and restores a run's parts; every rank calls save/restore together.

    `parts` must hold the run's TrainerState (its step names the folder).  They are saved and
    restored in their order: parts that refuse a checkpoint (another model, other data) go
    before Accelerate's, so that nothing is loaded from a checkpoint that is then refused."""

    def __init__(self, root: Path, keep: int, warn: Callable[[str], None],
                 parts: Sequence[Checkpointed], is_main: bool = True,
                 barrier: Callable[[], None] = lambda: None, keep_best: int = 0):
        """`barrier` waits for every rank (the Accelerator's wait_for_everyone)."""
        names = [part.name for part in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpointed parts share a name: {names}")
        states = [part for part in parts if isinstance(part, TrainerState)]
        if len(states) != 1:
            raise ValueError("the checkpointed parts must hold exactly one TrainerState")
        self.root, self.keep, self.warn = Path(root), keep, warn
        self.parts, self.state = list(parts), states[0]
        self.is_main, self.barrier = is_main, barrier
        self.keep_best = keep_best
        self.sealing = BackgroundSealing()

    def save(self, background: bool = False,
             sealed: Optional[Callable[[Path], None]] = None) -> Path:
        """Every part into `.tmp-step_N`, then the manifest, then the rename into place and the
        pruning; `sealed(path)` once it is in place (on other ranks: once their parts are
        written).  `background`: the main process seals on a thread (save_finishing.py) and
        returns as soon as every part is written; `wait` (or the next save) joins it."""
        self.wait()
        step = self.state.step
        final = self.root / checkpoint_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        with self._stopped_when_full(tmp, final):
            self._write_parts(tmp)
        if not self.is_main:
            if sealed is not None:
                sealed(final)
        elif background:
            self.sealing.start(lambda: self._seal(step, tmp, final, sealed))
        else:
            self._seal(step, tmp, final, sealed)
        if not background:
            self.barrier()  # every rank sees it in place, the old ones pruned
        return final

    def wait(self) -> None:
        """Until the save under way is sealed (nothing where none is); what failed in it,
        raised here (a full disk: RunStopped)."""
        self.sealing.wait()

    def _write_parts(self, tmp: Path) -> None:
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        for part in self.parts:
            if getattr(part, "collective", False):
                part.save(tmp)
            elif self.is_main:
                part.save(tmp)
        self.barrier()  # every rank's files are on disk before the manifest

    def _seal(self, step: int, tmp: Path, final: Path,
              sealed: Optional[Callable[[Path], None]]) -> None:
        """The main process: the manifest, the rename into place, the pruning."""
        with self._stopped_when_full(tmp, final):
            write_manifest(tmp, step)
            self._publish(tmp, final)
        self._prune()
        if sealed is not None:
            sealed(final)

    @contextlib.contextmanager
    def _stopped_when_full(self, tmp: Path, final: Path):
        """A full disk or quota while saving: RunStopped, the partial save removed."""
        try:
            yield
        except Exception as err:
            if not out_of_space(err, self.root):
                raise
            raise RunStopped(self._out_of_space_message(err, tmp, final), DISK_FULL_EXIT) \
                from err

    def _out_of_space_message(self, err: Exception, tmp: Path, final: Path) -> str:
        """Remove the partial save (it holds the space that is missing) and say what happened,
        what a checkpoint needs and where to resume from."""
        free = free_bytes(self.root)
        name = getattr(err, "filename", None) or _newest_file(tmp) or tmp
        written = _folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        complete = [p for p in list_checkpoints(self.root) if (p / MANIFEST).is_file()]
        if complete:
            need = f"a checkpoint of this run takes {_size(_folder_bytes(complete[0]))}"
            then = f"to continue from {complete[0]}"
        else:
            need = f"it had written {_size(written)} when it failed"
            then = "to start again (no checkpoint was complete yet)"
        return (f"no space left on the device of {self.root} (disk full or quota reached) "
                f"while writing {Path(name).name} of checkpoint {final.name}: {need}, "
                f"{_size(free)} was free; removed the partial "
                f"save; free some space, then run the same command with --resume auto {then}")

    def restore(self, path: Path) -> None:
        """Every part from a checkpoint that `resolve_resume` verified, on every rank; a
        UsageError when a part refuses it (pickled code, another model, other data...)."""
        check_format(path)
        for part in self.parts:
            part.load(path)

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
        """Keep the newest K complete checkpoints, and the best `keep_best` by the held-out
        --eval-metric (raw or EMA weights, the better) among those saved right after an
        evaluation (timm's checkpoint saver keeps its best the same way).  Each old one is
        renamed first and deleted after, so a kill mid-delete leaves a `.tmp-` folder, never a
        half-deleted checkpoint."""
        complete = [p for p in list_checkpoints(self.root) if (p / MANIFEST).is_file()]
        kept = set(complete[:self.keep]) | set(self._best(complete))
        for old in [p for p in complete if p not in kept]:
            doomed = self.root / f"{TMP_PREFIX}pruned-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _best(self, complete: list[Path]) -> list[Path]:
        if not self.keep_best:
            return []
        scored = []
        for path in complete:
            state = read_state(path)
            raw, ema = state.scores()
            if raw is not None and state.eval_step == state.step:
                # the better of the raw and the EMA weights, as the run's best and the final
                # model count them (TrainerState.note_evaluation, finish.py)
                score = max(rank(state.metric, raw), rank(state.metric, ema))
                scored.append((score, state.step, path))
        return [path for _, _, path in sorted(scored, reverse=True)[:self.keep_best]]


def _refusal(path: Path, err: Exception) -> str:
    return (f"checkpoint {path} holds a pickled object that is not plain tensors; refusing to "
            f"load it ({first_line(err)})")


