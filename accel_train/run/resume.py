"""The start plan: is this start fresh or a continuation, from which checkpoint, and with which
accumulation steps.  Made before the Accelerator exists (it fixes the accumulation steps at
construction), by rank 0 for everything that reads or moves files, and handed to every rank.

Policy lives here; checkpoint.py only knows the on-disk format.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from accel_train.run import distributed, runlock
from accel_train.run.checkpoint import (NAME_PATTERN, SUPERSEDED_PREFIX, check_format,
                                        find_latest_valid, list_checkpoints,
                                        recover_interrupted_saves, verify)
from accel_train.run.trainer_state import TrainerState, read_state
from accel_train.config import TrainConfig
from accel_train.run.distributed import LauncherEnv
from accel_train.base.errors import RunDiffers, UsageError
from accel_train.base.readers import read_text
from accel_train.run.rundir import (CHECKPOINTS_DIR, prepare_output_dir, refuse_new_run_over_old,
                                    run_paths)
from accel_train.run.runlock import RunLock
from accel_train.model.saved import ModelSpec


@dataclass(frozen=True)
class StartPlan:
    """What a start continues from, decided once and the same on every rank."""

    config: TrainConfig             # as given, with accumulation steps that keep the global batch
    env: LauncherEnv
    output_dir: Path
    checkpoint_dir: Path
    resume: Optional[str]           # the policy: None (a new run), "auto", or a path
    resume_from: Optional[Path]     # the verified checkpoint to continue from; None: from scratch
    previous: Optional[TrainerState]  # its trainer state
    messages: tuple[str, ...] = ()  # what planning printed, for the run's log ("warning: ...")
    kept_choices: tuple[str, ...] = ()  # what auto chose at the run's start, kept (keep_choices)
    lock: Optional[RunLock] = None  # the output directory's, on the global main rank
    # "accumulation steps 1 -> 2" (keep_global_batch): said once the resume is accepted
    accumulation_change: Optional[str] = None

    def release(self) -> None:
        """The run is over (finished, failed or stopped): another may write here."""
        if self.lock is not None:
            self.lock.release()


def plan_start(config: TrainConfig, env: LauncherEnv) -> StartPlan:
    """Decide the start without writing anything but checkpoint repairs (a killed save finished
    or discarded, newer checkpoints set aside): a failed start leaves no trace."""
    messages: list[str] = []

    def say(text: str) -> None:
        messages.append(text)
        distributed.print_once(text)

    def warn(text: str) -> None:
        say(f"warning: {text}")

    resume = resume_policy(config, env)
    held: list[RunLock] = []  # the main rank's lock on the output directory

    def choose_and_lock() -> str:
        path = Path(prepare_output_dir(config, env))
        # Before anything below reads, moves or deletes a file there: a second start on the
        # same folder stops here (runlock.py).
        held.append(runlock.take(run_paths(path).lock, distributed.run_lock_job(), warn))
        refuse_new_run_over_old(path, resume)
        return str(path)

    try:
        output_dir = Path(distributed.decide_on_main(choose_and_lock))
        refuse_a_checkpoint_file(config.checkpoint)
        checkpoint_dir = Path(config.checkpoint) if config.checkpoint else \
            run_paths(output_dir).checkpoints
        resume_from = distributed.decide_on_main(
            lambda: choose_resume_point(checkpoint_dir, resume, warn))
        resume_from = Path(resume_from) if resume_from else None
        previous = read_state(resume_from) if resume_from else None
        kept: tuple[str, ...] = ()
        accumulation_change = None
        if previous is not None:
            refuse_another_optimizer(config, previous, resume_from)
            config, accumulation_change = keep_global_batch(config, previous, env.world_size)
            config, kept = keep_choices(config, previous, resume_from)
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return StartPlan(config, env, output_dir, checkpoint_dir, resume, resume_from, previous,
                     tuple(messages), kept, held[0] if held else None, accumulation_change)


def refuse_a_checkpoint_file(checkpoint: Optional[str]) -> None:
    """The seed manual's --checkpoint is a file (model_checkpoint.pth); here it is the folder
    the step_XXXXXXXX checkpoints go in.  A new name makes that folder; an existing file ended
    the run at its first save, after training, with a NotADirectoryError."""
    if checkpoint and Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise UsageError(f"--checkpoint {checkpoint} is a file; accel_train keeps its "
                         f"checkpoints in a folder (a step_XXXXXXXX folder each, the final "
                         f"weights in the run's model.safetensors): pass a folder's name")


def refuse_another_optimizer(config: TrainConfig, previous: TrainerState,
                             checkpoint: Path) -> None:
    """A checkpoint's optimizer state fits only the optimizer that wrote it: torch would load
    SGD's state into Adam and fail deep inside (KeyError 'step').  Checkpoints written before
    the name was recorded are not checked."""
    if previous.optimizer is not None and previous.optimizer != config.optimizer:
        raise RunDiffers(f"--optimizer {config.optimizer}: {checkpoint} holds the state of "
                         f"--optimizer {previous.optimizer}; resume with --optimizer "
                         f"{previous.optimizer}, or start a new run in another --output-dir")


def keep_choices(config: TrainConfig, previous: TrainerState,
                 checkpoint: Path) -> tuple[TrainConfig, tuple[str, ...]]:
    """How the run computes is part of the run: where this start leaves precision, memory
    format, where JPEGs are decoded or whether photographs are held on the device to auto, it
    takes what the checkpoint ran with (what
    auto chose when the run began; timing again could choose otherwise, and exact resume
    would be lost).  Explicit flags win.
    So with the network --smaller-models chose (network_choice.py), when it is one of this
    start's --model and --smaller-models (another is refused as any other network is:
    ModelSpec.load).  Returns the config and what was kept."""
    changes, kept = {}, []
    if config.smaller_models:
        trained = ModelSpec.read(checkpoint).model_name
        if trained in (config.model, *config.smaller_models):
            changes.update(model=trained, smaller_models=[])
            kept.append("network")
    if config.mixed_precision == "auto" and previous.precision:
        changes["mixed_precision"], kept = previous.precision, kept + ["precision"]
    if config.channels_last is None and previous.channels_last is not None:
        changes["channels_last"], kept = previous.channels_last, kept + ["memory format"]
    if config.decode_on_device == "auto" and previous.decoded_on_device is not None:
        changes["decode_on_device"] = "always" if previous.decoded_on_device else "never"
        kept.append("decoding")
    if config.host_decode_share is None and previous.host_decode_share is not None:
        changes["host_decode_share"] = previous.host_decode_share
        kept.append("decoding share")
    if config.data_on_device == "auto" and previous.photos_held is not None:
        changes["data_on_device"] = "always" if previous.photos_held else "never"
        kept.append("photographs held")
    return dataclasses.replace(config, **changes), tuple(kept)


def resume_policy(config: TrainConfig, env: LauncherEnv) -> Optional[str]:
    """--resume as given; else 'auto' in a new round of a torchelastic job that already trained
    here: a worker its agent restarted (TORCHELASTIC_RESTART_COUNT > 0), or any worker of the
    job that started this output directory (see `started_by_elastic_job`).  Decided by all ranks
    together: restart counts are per machine, and ranks that disagreed about resuming would
    deadlock in their first collective."""
    if config.resume is not None:
        return config.resume
    continues = env.restart_count > 0 or started_by_elastic_job(config.output_dir, env.run_id)
    return "auto" if distributed.any_rank(continues) else None


def choose_resume_point(checkpoint_dir: Path, resume: Optional[str],
                        warn: Callable[[str], None]) -> Optional[str]:
    """Main process, before any rank reads the checkpoint folder: the checkpoint to resume
    from (None: start afresh), with killed saves finished or discarded.  Checkpoints of a
    later step are set aside only once every part has loaded (set_aside_newer, called by the
    trainer after its restore): a start that fails moves nothing."""
    if resume is None:
        check_fresh_checkpoint_dir(checkpoint_dir)
        return None
    path = resolve_resume(checkpoint_dir, resume, warn)
    if path is not None:
        check_format(path)
        read_state(path)  # its trainer state is read whole before anything else is
    return None if path is None else str(path)


def keep_global_batch(config: TrainConfig, previous: TrainerState,
                      num_processes: int) -> tuple[TrainConfig, Optional[str]]:
    """The global batch is part of the run: on another number of processes (or with another
    --batch-size) the accumulation steps change so that it stays what it was.  Returns the
    config and the line that says so, or None.  The line is not printed here: a start refused
    later (another --model, --seed, ...) would have said "resuming" just before its refusal, as
    though it had resumed; the trainer says it beside "resumed from" (records.open_records)."""
    accumulation = accumulation_for(previous, config.batch_size, num_processes)
    if accumulation == config.accumulation_steps:
        return config, None
    change = (f"the global batch of {previous.global_batch} kept on {num_processes} "
              f"process(es) x {config.batch_size}: accumulation steps "
              f"{config.accumulation_steps} -> {accumulation}")
    return dataclasses.replace(config, accumulation_steps=accumulation), change


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
        # One line per checkpoint passed over: said as warnings when an older one is used, else
        # (every checkpoint there refused) they are the error's reasons.
        skipped: list[str] = []
        latest = find_latest_valid(root, skipped.append)
        if latest is None and skipped:
            # Starting from scratch here would silently redo the run (a requeue loop would
            # never say so); only a folder without checkpoints starts a run.
            raise UsageError(f"--resume auto: none of the {len(skipped)} checkpoint(s) in {root} "
                             f"can be used ({'; '.join(skipped)}); pass --resume PATH to another "
                             f"checkpoint, or move them aside to start over")
        for text in skipped:
            warn(text)
        return latest
    chosen = _resolve_path(resume, warn)
    recover_interrupted_saves(root, warn)
    return chosen


def _resolve_path(resume: str, warn: Callable[[str], None]) -> Path:
    path = Path(resume)
    if NAME_PATTERN.match(path.name) is None and not list_checkpoints(path) \
            and list_checkpoints(path / CHECKPOINTS_DIR):
        path = path / CHECKPOINTS_DIR  # a run folder: its checkpoints (the default place)
    if NAME_PATTERN.match(path.name) is None and list_checkpoints(path):
        latest = find_latest_valid(path, warn)  # a checkpoints folder was given
        if latest is None:
            raise UsageError(f"--resume {resume}: no valid checkpoint in that folder; pass "
                             f"another folder, or --resume auto to start over if none is left")
        return latest
    if not path.is_dir():
        raise UsageError(f"--resume {resume}: no such checkpoint folder; pass a step_XXXXXXXX "
                         f"folder, its parent, the run folder, or 'auto'")
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
    raise RunDiffers(
        f"the checkpoint was trained with a global batch of {target} ({previous.batch_size} x "
        f"{previous.world_size} process(es) x {previous.accumulation_steps} accumulation), which "
        f"--batch-size {batch_size} on {num_processes} process(es) cannot make with whole "
        f"accumulation steps; use {hint}")


def check_fresh_checkpoint_dir(root: Path) -> None:
    """A new run must not write into (and prune) another run's checkpoints."""
    if list_checkpoints(root):
        raise UsageError(f"--checkpoint {root} already holds checkpoints of another run; pass "
                         f"--resume auto to continue it, or choose another --checkpoint folder")


# -- which elastic job a run directory belongs to ------------------------------------------------
def record_elastic_job(output_dir: Path, run_id: str) -> None:
    """Main process, once the run has started: remember which torchelastic job owns it (its
    rendezvous id, --rdzv-id)."""
    marker = run_paths(output_dir).elastic_job
    if run_id not in ("", "none") and not marker.exists():
        marker.write_text(run_id + "\n")


def started_by_elastic_job(output_dir: Optional[str], run_id: str) -> bool:
    """True when `output_dir` holds a run started by the torchelastic job `run_id`: a new round
    of that job (after a membership change the agents restart workers without counting a
    restart, and a machine that joins later counts from 0) must continue it, not refuse it."""
    if not output_dir or run_id in ("", "none"):
        return False
    marker = run_paths(output_dir).elastic_job
    # Read leniently: bytes that are not this job's id (damaged or not) mean another job.
    return marker.is_file() and read_text(marker, "elastic_job", errors="replace").strip() == run_id
