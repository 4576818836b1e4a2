"""`python -m tests.fault_entry ARGS`: the accel_train command line with faults and records
installed through the trainer's public callbacks (accel_train.callbacks, handed to the run as
trainer.run_training takes them) and by wrapping public functions of the product, for the
fault-tolerance tests.  torchrun and `accelerate launch` start it with `-m tests.fault_entry`
from the repository root.  The product itself reads none of these variables.

* FAULT_STALL_SAVE=STEP: in the first launch attempt (TORCHELASTIC_RESTART_COUNT unset or 0), the
  save of checkpoint STEP stalls after every file but the manifest is written, and says so on
  stdout ("fault injection: stalling the save of step STEP"), so a test can kill the process
  mid-save.  Restarted workers never stall: they must get past the same step to finish.
  The loop's saves are sealed on a thread (run/save_finishing.py): training goes on to the next
  save, which waits there; with FAULT_SEAL_IN_LINE=1 the whole process stalls in the save.
* FAULT_SEAL_IN_LINE=1: a callback with an on_checkpoint of its own (as a program that reads
  each checkpoint has), so that every save is sealed in line, the loop waiting for it.
* FAULT_STEP_SECONDS=S: every micro-batch of every rank takes at least S seconds more (a slow
  model), so that a test has time to act between two steps.
* FAULT_SLOW_SAVE=STEP:S: on the main process, the save of checkpoint STEP takes S seconds more
  before its manifest (a slow disk); the other ranks wait for it at the next save's barrier.
* FAULT_SLOW_DATA=S: rank 0's data preparation takes S seconds more (the other ranks wait for
  it before they start on theirs: distributed.main_first).
* FAULT_BLOCK_READ=INDEX: in a loader worker, reading the training image INDEX (a lazily
  decoded source) blocks for an hour, as a read from a dead network mount does (patched in each
  loader worker, which imports this module as `__mp_main__` as it starts; the training
  process's own reads go through).  SPLIT:INDEX names another split ("held-out:5"), and INDEX
  "*" any image of it: a sample limit keeps a subset of rows, which need not hold a given one.
* FAULT_POISON_STEP=STEP: right after the micro-batch of optimizer step STEP, the model's first
  parameter is filled with NaN (a run diverging at a known step).
* FAULT_STOP=RANK:STEP: in the first launch attempt, rank RANK stops itself with SIGSTOP as it
  starts the micro-batch of optimizer step STEP (as a process stuck in a driver call looks from
  outside), and is never continued: the other ranks wait in that step's collectives.  (A stop
  sent from outside at a moment a test picks could land while the other ranks wait at a
  checkpoint's barrier, under the long timeout, instead of in a step's collective.)
* FAULT_SAMPLE_LOG=1: every rank appends the sampler keys (epoch * N + index) of each micro-batch
  it trains on to <output-dir>/logs/samples-rank<R>.jsonl; a resumed start drops the records of
  the steps after its checkpoint (they are about to be redone), as it does for metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from accel_train.callbacks import Callback

STALL_ENV = "FAULT_STALL_SAVE"
SEAL_IN_LINE_ENV = "FAULT_SEAL_IN_LINE"
STEP_SECONDS_ENV = "FAULT_STEP_SECONDS"
SLOW_SAVE_ENV = "FAULT_SLOW_SAVE"
SLOW_DATA_ENV = "FAULT_SLOW_DATA"
BLOCK_READ_ENV = "FAULT_BLOCK_READ"
SAMPLE_LOG_ENV = "FAULT_SAMPLE_LOG"
POISON_ENV = "FAULT_POISON_STEP"
STOP_ENV = "FAULT_STOP"
STALL_SECONDS = 300  # long enough for any test to kill us; short enough not to hang CI forever
SAMPLE_LOG_GLOB = "samples-rank*.jsonl"


def before_manifest(delay) -> None:
    """`delay(step, folder)` runs on the main process once every file of a save is written,
    before the manifest makes it count: in the checkpoint's manifest writer, wrapped."""
    from accel_train.run import checkpoint

    write_manifest = checkpoint.write_manifest

    def delayed(directory: Path, step: int) -> None:
        delay(step, directory)
        write_manifest(directory, step)

    checkpoint.write_manifest = delayed


def stall_before_manifest(wanted_step: int):
    def stall(step: int, folder: Path) -> None:
        if step != wanted_step or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
            return
        print(f"fault injection: stalling the save of step {step} before its manifest", flush=True)
        deadline = time.monotonic() + STALL_SECONDS
        while time.monotonic() < deadline:  # short sleeps: a signal handler still runs promptly
            time.sleep(0.05)
    return stall


class SeesCheckpoints(Callback):
    """Has its own on_checkpoint: the trainer then seals each save before going on."""

    def on_checkpoint(self, trainer, path: Path) -> None:
        pass


class SampleLog(Callback):
    """Per-rank JSON lines {"step": optimizer step the micro-batch belongs to, "keys": [...]}."""

    def __init__(self, log_dir: Path, rank: int):
        self.log_dir = Path(log_dir)
        self.path = self.log_dir / f"samples-rank{rank}.jsonl"
        self.rank = rank

    def on_batch_start(self, trainer, batch) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": trainer.state.step + 1,
                                     "keys": batch.keys.tolist()}) + "\n")

    def on_train_begin(self, trainer) -> None:
        """Rank 0, as a start begins (every rank waits for the others after this): forget the
        micro-batches of steps after the one it starts from, in every rank's file (the world
        size may have changed, so some files have no rank left to clean them)."""
        if self.rank != 0:
            return
        step = trainer.state.step
        for path in self.log_dir.glob(SAMPLE_LOG_GLOB):
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))


def read_sample_keys(log_dir: Path) -> list[int]:
    """Every key trained on, over all ranks and restarts."""
    keys: list[int] = []
    for path in sorted(Path(log_dir).glob(SAMPLE_LOG_GLOB)):
        for line in path.read_text().splitlines():
            if line.strip():
                keys.extend(json.loads(line)["keys"])
    return keys


def _output_dir(argv: list[str]) -> Path:
    for i, arg in enumerate(argv):
        if arg in ("--output-dir", "--output_dir") and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith(("--output-dir=", "--output_dir=")):
            return Path(arg.split("=", 1)[1])
    raise SystemExit(f"{SAMPLE_LOG_ENV} needs --output-dir on the command line")


def slow_save(wanted_step: int, seconds: float):
    def slow(step: int, folder: Path) -> None:
        if step == wanted_step:
            print(f"fault injection: the save of step {step} takes {seconds:g} s more",
                  flush=True)
            time.sleep(seconds)
    return slow


def slow_data_preparation(seconds: float) -> None:
    """Rank 0's load_data (the trainer's name for it) takes `seconds` more."""
    from accel_train import trainer

    if int(os.environ.get("RANK", 0)) != 0:
        return
    load_data = trainer.load_data

    def slower(config):
        print(f"fault injection: rank 0 prepares the data {seconds:g} s longer", flush=True)
        time.sleep(seconds)
        return load_data(config)

    trainer.load_data = slower


def poison_weights_after(wanted_step: int) -> None:
    """The trainer's first parameter becomes NaN after the micro-batch of step `wanted_step`."""
    import torch
    from accel_train import trainer

    train_step = trainer.Trainer.train_step

    def poisoned(self, images, labels):
        result = train_step(self, images, labels)
        if self.state.step + 1 == wanted_step:
            with torch.no_grad():
                next(self.bare_model().parameters()).fill_(float("nan"))
        return result

    trainer.Trainer.train_step = poisoned


class StopAt(Callback):
    """`where` is "RANK:STEP" (module docstring, FAULT_STOP)."""

    def __init__(self, where: str):
        self.rank, self.step = (int(part) for part in where.split(":"))

    def on_batch_start(self, trainer, batch) -> None:
        import signal

        if (trainer.state.step + 1 == self.step and int(os.environ.get("RANK", 0)) == self.rank
                and not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))):
            print(f"fault injection: rank {self.rank} stops itself at step {self.step}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


class SlowSteps(Callback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_batch_start(self, trainer, batch) -> None:
        time.sleep(self.seconds)


def block_read(where: str) -> None:
    """A loader worker's read of image INDEX of SPLIT blocks for an hour (`where`:
    "INDEX" for the train split, or "SPLIT:INDEX"; INDEX "*" is any image)."""
    from accel_train.data.sources import HFSource

    split, _, index = where.rpartition(":")
    split = split or "train"
    samples_at = HFSource.samples_at

    def blocking(self, indices):
        from torch.utils.data import get_worker_info

        wanted = index == "*" or int(index) in [int(i) for i in indices]
        if (self.split == split and wanted
                and get_worker_info() is not None):  # a loader worker's read, not the trainer's
            time.sleep(3600)
        return samples_at(self, indices)

    HFSource.samples_at = blocking


def callbacks_from_environ(argv: list[str]) -> list[Callback]:
    """The callbacks the variables ask for (slow steps first, so that a stop or a record
    happens after the step's delay), with the wrapped functions they ask for installed."""
    if os.environ.get(STALL_ENV):
        before_manifest(stall_before_manifest(int(os.environ[STALL_ENV])))
    if os.environ.get(SLOW_SAVE_ENV):
        step, seconds = os.environ[SLOW_SAVE_ENV].split(":")
        before_manifest(slow_save(int(step), float(seconds)))
    if os.environ.get(SLOW_DATA_ENV):
        slow_data_preparation(float(os.environ[SLOW_DATA_ENV]))
    if os.environ.get(POISON_ENV):
        poison_weights_after(int(os.environ[POISON_ENV]))
    callbacks: list[Callback] = []
    if float(os.environ.get(STEP_SECONDS_ENV) or 0):
        callbacks.append(SlowSteps(float(os.environ[STEP_SECONDS_ENV])))
    if os.environ.get(SEAL_IN_LINE_ENV, "") not in ("", "0"):
        callbacks.append(SeesCheckpoints())
    if os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0"):
        callbacks.append(SampleLog(_output_dir(argv) / "logs", int(os.environ.get("RANK", 0))))
    if os.environ.get(STOP_ENV):
        callbacks.append(StopAt(os.environ[STOP_ENV]))
    return callbacks


def main() -> int:
    import functools

    from accel_train import cli, trainer

    argv = sys.argv[1:]
    # cli.main looks run_training up as it trains: the run gets these callbacks
    trainer.run_training = functools.partial(trainer.run_training,
                                             callbacks=callbacks_from_environ(argv))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())  # as `python -m accel_train` ends (cli.entry)
elif __name__ == "__mp_main__" and os.environ.get(BLOCK_READ_ENV):
    block_read(os.environ[BLOCK_READ_ENV])  # each loader worker imports us as it starts
