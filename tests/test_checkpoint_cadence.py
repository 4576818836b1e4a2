"""--checkpoint-minutes' clock (run/checkpoint_cadence.py), on a clock the test moves: an epoch
end saves once the minutes since the last save (or the start) have passed, from the last save's
start; a `must` end saves whatever the clock says; 0 saves at every end.  Which ends are `must`,
and that skipped ends leave the training as it was: tests/test_option_effects.py's run; two
ranks asking rank 0's clock at each epoch end: the torchrun run here."""

from __future__ import annotations

import pytest

from accel_train.callbacks import Callback
from accel_train.cli import build_train_parser, config_from_args
from accel_train.run.checkpoint_cadence import CheckpointCadence
from accel_train.trainer import run_training
from conftest import TINY_TRAIN, run
from faults import checkpoint_steps, torchrun_cmd
from test_loader_workers import StopAtStep  # SIGTERM at a step: a stop signal's save


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_epoch_end_saves_once_the_minutes_since_the_last_save_have_passed():
    clock = Clock()
    cadence = CheckpointCadence(1.5, clock)  # 90 s
    answers = []
    for now in (1030, 1089, 1090):
        clock.now = now
        answers.append(cadence.epoch_end_saves(must=False))
    assert answers == [False, False, True]  # counted from the start, 90 s passed at 1090
    cadence.saved()
    clock.now = 1179
    assert not cadence.epoch_end_saves(must=False)
    assert cadence.epoch_end_saves(must=True)
    cadence.saved()  # the must's save at 1179 restarts the count
    clock.now = 1268
    assert not cadence.epoch_end_saves(must=False)
    clock.now = 1269
    assert cadence.epoch_end_saves(must=False)


def test_zero_minutes_saves_at_every_epoch_end():
    clock = Clock()
    cadence = CheckpointCadence(0, clock)
    assert cadence.epoch_end_saves(must=False)
    cadence.saved()
    assert cadence.epoch_end_saves(must=False)


class TenSecondSteps(Callback):
    """The run's cadence on a clock that moves 10 s at every optimizer step (the trainer's
    `cadence` swapped at the training's start, before any epoch end asks it)."""

    def __init__(self, minutes: float):
        self.clock, self.minutes = Clock(), minutes

    def on_train_begin(self, trainer) -> None:
        trainer.cadence = CheckpointCadence(self.minutes, self.clock)

    def on_step_end(self, trainer, step: int) -> None:
        self.clock.now += 10


def test_the_trainers_saves_restart_the_count(tmp_path):
    """4 epochs of 4 steps, 10 s a step, --checkpoint-minutes 1: the epoch ends come 40 s
    apart; the end at step 8 is 80 s in and saves, so the one at step 12 is 40 s after that
    save and skips (counted from the start instead, it would save), then the last step."""
    assert _train(tmp_path, TenSecondSteps(1)) == (0, [8, 16])


def test_a_stop_signal_saves_whatever_the_clock_says(tmp_path):
    """SIGTERM at step 6, --checkpoint-minutes 60: the stop's save is made (exit 143), and the
    epoch end at step 4 before it was skipped."""
    assert _train(tmp_path, StopAtStep(6), minutes="60") == (143, [6])


def _train(tmp_path, callback: Callback, minutes: str = "1") -> tuple[int, list[int]]:
    """4 epochs of 4 steps in this process with `callback`; the exit code and the steps
    saved."""
    argv = [a for a in TINY_TRAIN if a not in ("--epochs", "1")]
    out = tmp_path / "run"
    config = config_from_args(build_train_parser().parse_args(
        [*argv, "--synthetic-train-size", "64", "--epochs", "4", "--checkpoint-minutes", minutes,
         "--keep-checkpoints", "10", "--output-dir", str(out)]), environ={})
    return run_training(config, [callback]), checkpoint_steps(out)


@pytest.mark.slow
def test_two_ranks_skip_the_same_epoch_ends(tmp_path):
    """torchrun, 2 processes over gloo: 4 epochs of 2 steps (a global batch of 32 of 64
    images), --checkpoint-minutes 60 and --checkpoint-every 3: every rank asks rank 0 at the
    three epoch ends before the last (a rank that did not would leave the others waiting in
    the broadcast, and a save made by one rank alone would wait at its barrier): the saves are
    step 3 (mid-epoch) and step 8 (the last); step 6 ends an epoch, which the hour skips."""
    argv = [a for a in TINY_TRAIN if a not in ("--epochs", "1")]
    out = tmp_path / "run"
    run(torchrun_cmd(*argv, "--synthetic-train-size", "64", "--epochs", "4",
                     "--checkpoint-every", "3", "--checkpoint-minutes", "60",
                     "--keep-checkpoints", "20", "--output-dir", str(out)),
        timeout=240, check=True)
    assert checkpoint_steps(out) == [3, 8]
