"""--time-budget: the duration syntax, the arithmetic that fixes the number of steps, and, on 2
processes under torchrun, one agreed step count that a stopped-and-resumed run keeps.

Oracles: hand-computed durations and step counts; for the step count, a brute-force search for
the largest total whose remaining steps plus the evaluations at the ends of the epochs before the
last fit the time left (budget.py's own contract); for the runs, every record of the step count
(metrics.jsonl's one "budget" record, each rank's log, each checkpoint's trainer_state.json,
config.yaml) and the step the run really ends at.  The clock of the unit tests is a fake one.
"""

from __future__ import annotations

import json
import math
import re
import signal
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from accel_train.train import budget
from accel_train.train.budget import TimeBudget
from accel_train.config import parse_duration
from accel_train.run.checkpoint import verify
from accel_train.base.errors import UsageError
from conftest import accel_train_here, TINY_TRAIN, free_port
from faults import Run, checkpoint_steps, metrics, metrics_so_far, wait_until



# -- the duration syntax --------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("600", 600), ("90s", 90), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("2m30s", 150),
    ("1h0m5s", 3605), ("1.5h", 5400), ("0.5m", 30), (" 10M ", 600), ("45", 45), ("1s", 1),
    ("0.5", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "", "10x", "-5", "m", "h", "0", "0s", "0m0s", "1h-30m",
                                  "10 m", "1e3", "ten minutes", "30m1h"])
def test_bad_durations_are_usage_errors_naming_the_flag(text):
    with pytest.raises(UsageError, match="--time-budget"):
        parse_duration(text)


# -- the arithmetic -------------------------------------------------------------------------------

# What the trainer's evaluation probe reads on the fake clock: each view of a held-out batch of
# 16 in 0.5 s, half the fake clock's 1 s step (so an image's pass costs what EVAL_COST_PER_IMAGE
# would estimate); --tta flip views each image twice, flip-translate six times (evaluate.py).
PROBE_SECONDS, VIEWS = 0.5, {"none": 1, "flip": 2, "flip-translate": 6}


def fake_probe(seconds: float, clock=None):
    """A stand-in for evaluate.batch_seconds: `seconds` per view of a batch of 16; with `clock`,
    the time it takes passes on it (two batches, as the real one times)."""
    def probe(accelerator, model, dataset, batch_size, channels_last, tta, finish=None):
        assert batch_size == 16, batch_size  # the tests' --batch-size: a held-out batch
        if clock is not None:
            clock.now += 2 * seconds * VIEWS[tta]
        return seconds * VIEWS[tta], 16
    return probe


def fake_clock(monkeypatch) -> SimpleNamespace:
    """A fake perf_counter for budget.py (set `clock.now`), and the trainer's evaluation probe
    reading PROBE_SECONDS per view of a batch (the tests of `batch_seconds` below check the real
    one)."""
    from accel_train.train import evaluate

    fake = SimpleNamespace(now=0.0)
    monkeypatch.setattr(budget, "time", SimpleNamespace(perf_counter=lambda: fake.now))
    monkeypatch.setattr(evaluate, "batch_seconds", fake_probe(PROBE_SECONDS))
    return fake


def ticking(clock, seconds=lambda step: 1.0) -> list:
    """The callbacks of a run on the fake clock: before each micro-batch of optimizer step
    `step` the clock moves `seconds(step)` (the run is in this process, and takes no real time
    on the budget's clock)."""
    from accel_train.callbacks import Callback

    class Tick(Callback):
        def on_batch_start(self, trainer, batch) -> None:
            clock.now += seconds(trainer.state.step + 1)

    return [Tick()]


@pytest.fixture
def clock(monkeypatch):
    return fake_clock(monkeypatch)


def _total(clock, seconds, elapsed, step_seconds, steps_done, steps_per_epoch, eval_images,
           global_batch, eval_every: int = 1) -> int:
    clock.now = 1000.0
    timer = TimeBudget(seconds)
    timer.start(0)
    clock.now = 1000.0 + elapsed
    return timer.total_steps(step_seconds, steps_done, steps_per_epoch, eval_images,
                             global_batch, eval_every)


def _largest_that_fits(seconds, elapsed, step_seconds, steps_done, steps_per_epoch,
                       eval_images, global_batch, eval_seconds=None, eval_every=1,
                       plain_seconds=0.0) -> int | None:
    """Brute force: the most steps whose remaining training plus the epoch ends still to come
    fit the time left.  An end evaluates when its epoch is a multiple of `eval_every` (never
    for 0) and at the last epoch (partial or not: the final evaluation); it then costs
    `eval_seconds` when one was measured, else an evaluated image costs EVAL_COST_PER_IMAGE of a
    trained one; an end that does not evaluate costs `plain_seconds`.  The epoch ends already
    behind are those of the epochs finished before step `steps_done` (a fit inside an epoch's
    last step still has that epoch's end to come)."""
    left = seconds - elapsed
    if eval_seconds is None:
        eval_seconds = eval_images * budget.EVAL_COST_PER_IMAGE * step_seconds / global_batch
    behind = sum(1 for end in range(steps_per_epoch, steps_done, steps_per_epoch))
    best = None
    for total in range(steps_done + 1, steps_done + int(left / step_seconds) + 2):
        last = math.ceil(total / steps_per_epoch)
        ends = 0.0
        for epoch in range(behind + 1, last + 1):
            evaluates = epoch == last or (eval_every > 0 and epoch % eval_every == 0)
            ends += eval_seconds if evaluates else plain_seconds
        if (total - steps_done) * step_seconds + ends <= left + 1e-9:
            best = total
    return best


def test_the_documented_evaluation_cost():
    assert budget.EVAL_COST_PER_IMAGE == 0.5  # "estimated at half"; the hand numbers use it


def test_each_forward_pass_over_the_held_out_images_is_budgeted():
    assert [budget.evaluation_passes(ema, tta) for ema in (False, True)
            for tta in ("none", "flip")] == [1, 2, 2, 4]


def test_step_count_by_hand(clock):
    # 100 s budget, 10 s gone after 13 steps, 0.5 s a step, 50 steps an epoch, an evaluation of
    # 1,000 images at a global batch of 100 costs 1000 * 0.5 * 0.5 / 100 = 2.5 s.  Left: 90 s.
    # 173 steps: 160 more steps (80 s) + 4 evaluations (the ends of epochs 1-3 and the final one
    # at step 173; 10 s) = 90 s.  174 steps: 80.5 s + 10 s = 90.5 s: too many.
    assert _total(clock, 100, 10, 0.5, 13, 50, 1000, 100) == 173
    # no held-out images to evaluate: 13 + 90 / 0.5
    assert _total(clock, 100, 10, 0.5, 13, 50, 0, 100) == 193


def test_step_count_is_the_largest_that_fits_when_evaluations_are_costly(clock):
    # 100 s, 1 s a step, 10 steps an epoch, an evaluation costs 200 * 0.5 * 1 / 10 = 10 s.
    # 50 steps: 50 s + 5 evaluations (the last the final one; 50 s) = 100 s fits; 51-60 steps
    # need 6 (111 s and more).  So 50 steps; not 10 (a tenth of the budget).
    assert _total(clock, 100, 0, 1.0, 0, 10, 200, 10) == 50


@pytest.mark.parametrize("case", [
    (100, 10, 0.5, 13, 50, 1000, 100),
    (100, 0, 1.0, 0, 10, 200, 10),
    (600, 5, 0.041, 13, 781, 10000, 64),   # CIFAR-10 on this machine, the 41 ms/step
    (60, 5, 0.2, 13, 8, 64, 32),           # this file's 2-process run
    (100, 10, 0.5, 13, 50, 100, 100),
    (30, 3, 0.25, 13, 5, 640, 16),
    (3600, 60, 0.3, 13, 390, 10000, 128),
], ids=str)
def test_step_count_fits_and_is_the_largest_that_does(clock, case):
    total = _total(clock, *case)
    assert total == _largest_that_fits(*case), (total, _largest_that_fits(*case))


def test_eval_every_budgets_only_the_evaluations_that_will_run(clock):
    # The costly case above (100 s, 1 s a step, 10 steps an epoch, 10 s an evaluation):
    # --eval-every 0 evaluates once, at the end: 90 steps + 10 s.  --eval-every 2: 60 steps
    # = 60 s + the ends of epochs 2, 4, 6 (30 s); 61 steps make a 7th epoch whose end is the
    # last and evaluates too: 61 + 40 s.  --eval-every 3: 70 steps + the ends of epochs 3, 6
    # and 7 (30 s) = 100 s; 71 steps make an 8th epoch, evaluated at 3, 6, 8: 71 + 30 > 100.
    assert _total(clock, 100, 0, 1.0, 0, 10, 200, 10, eval_every=0) == 90
    assert _total(clock, 100, 0, 1.0, 0, 10, 200, 10, eval_every=2) == 60
    assert _total(clock, 100, 0, 1.0, 0, 10, 200, 10, eval_every=3) == 70
    assert _total(clock, 100, 0, 1.0, 0, 10, 200, 10, eval_every=1) == 50
    # From step 0 every epoch end is still to come, the first too: 5 s an evaluation (100
    # images), 65 steps + the ends of epochs 1-7 (35 s) = 100 s; 66 steps need 101 s.
    assert _total(clock, 100, 0, 1.0, 0, 10, 100, 10, eval_every=1) == 65


@pytest.mark.parametrize("eval_every", [0, 2, 3, 7])
@pytest.mark.parametrize("case", [
    (100, 10, 0.5, 13, 50, 1000, 100),
    (100, 0, 1.0, 0, 10, 200, 10),
    (100, 46, 1.0, 31, 10, 100, 10),
    (600, 5, 1.1, 13, 48, 20000, 1024),    # the CPU recipe: 48 steps an epoch, flip TTA
    (3600, 60, 0.3, 13, 390, 10000, 128),
], ids=str)
def test_eval_every_step_count_is_the_largest_that_fits(clock, case, eval_every):
    assert _total(clock, *case, eval_every=eval_every) == \
        _largest_that_fits(*case, eval_every=eval_every)


@pytest.mark.parametrize("steps_done", [13, 40, 50, 59, 61])
@pytest.mark.parametrize("eval_every", [0, 1, 2, 3])
def test_epoch_ends_without_an_evaluation_are_measured_apart(clock, steps_done, eval_every):
    """An epoch end that evaluates (30 s) and one that does not (3 s: a checkpoint), each
    measured in `paused`: the fit budgets each kind of end to come at its own cost (checked
    against the brute force from several places in the run: 20 steps an epoch)."""
    clock.now = 0.0
    timer = TimeBudget(600)
    timer.start(0)
    clock.now = 100.0
    with timer.paused(evaluates=False):
        clock.now += 3.0
    with timer.paused(evaluates=True):
        clock.now += 30.0
    assert timer.epoch_end_seconds == pytest.approx(30.0)  # the latest evaluating end
    assert timer.plain_end_seconds() == pytest.approx(3.0)
    assert timer.total_steps(0.5, steps_done, 20, 0, 100, eval_every) == \
        _largest_that_fits(600, 133.0, 0.5, steps_done, 20, 0, 100, eval_seconds=30.0,
                           eval_every=eval_every, plain_seconds=3.0)


@pytest.mark.parametrize("ended, last, eval_every, expected", [
    (0, 10, 1, (10, 10)), (0, 10, 0, (10, 1)), (0, 10, 3, (10, 4)),  # 3, 6, 9 and 10
    (0, 9, 3, (9, 3)),    # 3, 6, 9: the last is a multiple
    (4, 10, 3, (6, 3)),   # 6, 9, 10
    (6, 6, 2, (0, 0)), (5, 5, 2, (0, 0)), (3, 3, 0, (0, 0)), (5, 6, 4, (1, 1)),
    (0, 1, 5, (1, 1))])
def test_epoch_ends_to_come_by_hand(ended, last, eval_every, expected):
    assert budget.epoch_ends_to_come(ended, last, eval_every) == expected


def test_epoch_ends_already_behind_are_not_budgeted_again(clock):
    # 100 s, 40 s gone at step 25 with 10 steps an epoch: the ends of epochs 1 and 2 are behind
    # (their time is in the 40 s), epoch 3's (at step 30) is to come.  1 s a step, an evaluation
    # 5 s (100 images x 0.5 x 1 s / 10).  Left 60 s: 45 steps = 20 more (20 s) + the ends of
    # epochs 3, 4, 5 (15 s) = 35 s; 49 steps = 24 s + 15 s; 50 steps = 25 + 15 = 40 s; 51 steps
    # need a sixth end: 26 + 20 = 46 s; ... 55 steps = 30 + 20 = 50 s; 56 need a seventh: 31 + 25
    # = 56 s; 59 steps = 34 + 25 = 59 s; 60 steps = 35 + 25 = 60 s fits; 61 needs an eighth.
    assert _total(clock, 100, 40, 1.0, 25, 10, 100, 10) == 60
    # At step 30 (epoch 3's last step, its end still to come) the same count.
    assert _total(clock, 100, 45, 1.0, 30, 10, 100, 10) == 60
    # At step 31 epoch 3's end is behind too: 54 s left, 29 more steps and the ends of epochs
    # 4, 5 and 6 (15 s) = 44 s; ... 60 steps = 29 + 15 = 44 s; 61 needs a seventh end: 30 + 20
    # = 50 s; 65 steps = 34 + 20 = 54 s fits, 66 = 35 + 20 = 55 s does not
    assert _total(clock, 100, 46, 1.0, 31, 10, 100, 10) == \
        _largest_that_fits(100, 46, 1.0, 31, 10, 100, 10) == 65


def test_a_first_fit_with_no_room_for_a_step_ends_the_run_where_it_stands(clock):
    """By the first fit the run has trained: its steps are kept (evaluated and saved), not
    thrown away as bad input after the fact."""
    assert _total(clock, 10, 9.8, 0.5, 13, 50, 0, 100) == 13
    assert _total(clock, 10, 12, 0.5, 13, 50, 0, 100) == 13  # already over


def _readings(clock, timer, first_step, step_times, refits: bool = False):
    """Drive `timer` through steps taking `step_times` seconds each (settling every reading as
    a single rank would); the (step, reading, fit now?) triples it gave, up to the first fit
    (or all of them, with `refits`)."""
    answers = []
    for step, seconds in enumerate(step_times, start=first_step + 1):
        clock.now += seconds
        reading = timer.measure(step)
        if reading is not None:
            answers.append((step, pytest.approx(reading), timer.settle(reading)))
            if answers[-1][2] and not refits:
                break
    return answers


def test_a_short_budget_is_fitted_to_the_pilot_alone(clock):
    """Three slow warm-up steps (5 s each: compilation, cold caches) are not measured; the next
    ten steps of 0.5 s are, and at the thirteenth step that reading is final: 20 s leaves no
    room for a longer window (8% of 20 s is 4 steps of 0.5 s, fewer than the pilot's ten).  The
    pilot's first step alone gives an estimate before (it only paces the warmup)."""
    assert (budget.WARM_STEPS, budget.GLIMPSE_STEPS, budget.MEASURED_STEPS) == (3, 1, 10)
    clock.now = 0.0
    timer = TimeBudget(20)
    timer.start(40)  # a run that starts (or resumes) at step 40
    answers = _readings(clock, timer, 40, [5.0] * 3 + [0.5] * 30)
    assert answers == [(44, pytest.approx(0.5), False), (53, pytest.approx(0.5), True)], answers
    assert timer.step_seconds == pytest.approx(0.5) == timer.pilot_seconds == \
        timer.glimpse_seconds


def test_a_long_budget_times_a_second_window_after_the_machine_settles(clock):
    """600 s: the pilot (steps 4-13, 1.0 s each: still warming up) reads 1.0 s; the second
    window waits 2% of the budget at the pilot's pace (12 steps) and times 8% (48 steps), by
    when steps take 0.5 s: steps 26-73 are measured, and 0.5 s is the final reading."""
    assert (budget.SETTLE_FRACTION, budget.MEASURE_FRACTION) == (0.02, 0.08)
    clock.now = 0.0
    timer = TimeBudget(600)
    timer.start(0)
    answers = _readings(clock, timer, 0, [5.0] * 3 + [1.0] * 10 + [0.7] * 12 + [0.5] * 70)
    assert answers == [(4, pytest.approx(1.0), False), (13, pytest.approx(1.0), False),
                       (73, pytest.approx(0.5), True)], answers
    assert (timer.pilot_seconds, timer.step_seconds) == (pytest.approx(1.0), pytest.approx(0.5))
    assert timer.measure(74) is None  # the next window (for a re-fit) has only just begun


def test_the_pilot_starts_right_after_the_warm_steps(clock):
    """Warm steps 1-3 are left out, step 4 is the pilot's first (1.5 s: the first estimate's
    reading), then nine of 0.5 s: (1.5 + 9 x 0.5) / 10 = 0.6 s."""
    clock.now = 0.0
    timer = TimeBudget(20)
    timer.start(0)
    answers = _readings(clock, timer, 0, [5.0] * 3 + [1.5] + [0.5] * 20)
    assert answers == [(4, pytest.approx(1.5), False), (13, pytest.approx(0.6), True)], answers


def test_the_second_window_is_sized_in_steps_at_the_pilots_pace(clock):
    """1000 s with a 2 s pilot: wait 2% of the budget = 10 steps and time 8% = 40 steps at 2 s
    a step, i.e. steps 24-63 (at 1 s each by then)."""
    clock.now = 0.0
    timer = TimeBudget(1000)
    timer.start(0)
    answers = _readings(clock, timer, 0, [5.0] * 3 + [2.0] * 10 + [1.0] * 100)
    assert answers == [(4, pytest.approx(2.0), False), (13, pytest.approx(2.0), False),
                       (63, pytest.approx(1.0), True)], answers


def test_a_second_window_no_longer_than_the_pilot_is_not_timed(clock):
    """125 s at 1 s a step: 8% is exactly the pilot's 10 steps, so the pilot's reading is final."""
    clock.now = 0.0
    timer = TimeBudget(125)
    timer.start(0)
    answers = _readings(clock, timer, 0, [5.0] * 3 + [1.0] * 30)
    assert answers == [(4, pytest.approx(1.0), False), (13, pytest.approx(1.0), True)], answers


def test_an_epoch_end_inside_the_window_is_left_out(clock):
    """The same 600 s run with 20 steps an epoch: the epoch-end evaluation and checkpoint (30 s,
    inside `paused`) fall into the second window; it still reads 0.5 s a step, and the budget's
    own clock counted the 30 s."""
    clock.now = 0.0
    timer = TimeBudget(600)
    timer.start(0)
    answers = []
    for step, seconds in enumerate([5.0] * 3 + [1.0] * 10 + [0.7] * 12 + [0.5] * 48, start=1):
        clock.now += seconds
        reading = timer.measure(step)
        if reading is not None:
            answers.append((step, pytest.approx(reading), timer.settle(reading)))
        if step % 20 == 0:
            with timer.paused():
                clock.now += 30.0
    assert answers == [(4, pytest.approx(1.0), False), (13, pytest.approx(1.0), False),
                       (73, pytest.approx(0.5), True)], answers
    # 3 x 5 + 10 x 1 + 12 x 0.7 + 48 x 0.5 s of steps and three 30 s epoch ends, at step 73;
    # the epoch end measured (30 s) is what the ones to come will cost, the estimate (here 0 s:
    # no held-out images) no longer counts.
    elapsed = 15 + 10 + 8.4 + 24 + 90
    assert timer.epoch_end_seconds == pytest.approx(30.0)
    assert timer.total_steps(0.5, 73, 20, 0, 100) == \
        _largest_that_fits(600, elapsed, 0.5, 73, 20, 0, 100, eval_seconds=30.0)


def test_after_the_fit_each_window_of_two_percent_is_timed_for_a_re_fit(clock):
    """The 600 s run fitted at step 73 (0.5 s a step): windows of 2% of the budget in steps at
    the agreed pace follow with no step left out: 24 steps (12 s / 0.5 s) twice, the second
    timing steps of 1 s (another job arrived), then windows of 12 steps; each reading is a
    fit."""
    assert budget.REFIT_FRACTION == 0.02
    clock.now = 0.0
    timer = TimeBudget(600)
    timer.start(0)
    times = [5.0] * 3 + [1.0] * 10 + [0.7] * 12 + [0.5] * 48 + [0.5] * 24 + [1.0] * 36
    answers = _readings(clock, timer, 0, times, refits=True)
    assert answers == [(4, pytest.approx(1.0), False), (13, pytest.approx(1.0), False),
                       (73, pytest.approx(0.5), True), (97, pytest.approx(0.5), True),
                       (121, pytest.approx(1.0), True), (133, pytest.approx(1.0), True)], answers


def test_a_short_budget_re_fits_after_every_step(clock):
    """20 s at 1 s a step: 2% of the budget is less than a step, so each step is a window."""
    clock.now = 0.0
    timer = TimeBudget(20)
    timer.start(0)
    answers = _readings(clock, timer, 0, [1.0] * 16, refits=True)
    assert [step for step, _, fit in answers if fit] == [13, 14, 15, 16], answers


def test_a_late_fit_with_no_time_left_ends_the_run_where_it_stands(clock):
    clock.now = 0.0
    timer = TimeBudget(100)
    timer.start(0)
    clock.now = 50.0
    assert timer.total_steps(0.5, 13, 50, 0, 100) > 13  # the first fit
    clock.now = 100.5  # the machine slowed down and the budget is spent
    assert timer.total_steps(5.0, 60, 50, 0, 100) == 60  # no error: stop here


# -- 2 processes under torchrun -------------------------------------------------------------------

BUDGET = "20s"
# 256 images, 2 x 16: 8 steps an epoch.  No --epochs: the budget decides the length.
BUDGET_TRAIN = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", BUDGET,
                "--checkpoint-every", "10", "--log-every", "1", "--keep-checkpoints", "100",
                "--warmup-fraction", "0.3", "--eval-every", "0"]
PACED = re.compile(r"warmup paced by an estimate at step (\d+), ([\d,]+) steps")
ANNOUNCED = re.compile(r"time budget " + re.escape(BUDGET) + r": ([\d,]+) steps")



def _window_end(pilot_seconds: float) -> int:
    """The step at which a BUDGET run fixes its count, by budget.py's documented rule: the
    pilot ends at step 13; a second window follows only if 8% of the budget holds more than
    ten steps at the pilot's pace, after 2% of it."""
    seconds, pilot_end = parse_duration(BUDGET), 13
    length = math.ceil(0.08 * seconds / pilot_seconds)
    if length <= 10:
        return pilot_end
    return pilot_end + math.ceil(0.02 * seconds / pilot_seconds) + length


def _torchrun(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            "2", "--max-restarts", "0", "--monitor-interval", "0.5", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]


def _announced(out, rank: int) -> list[int]:
    path = out / "logs" / f"rank{rank}.log"
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [int(n.replace(",", "")) for n in ANNOUNCED.findall(text)]


def _budget_records(out) -> list[dict]:
    return [r for r in metrics_so_far(out) if r["type"] == "budget"]  # (polled while it runs)


def _state(out, step: int) -> dict:
    """A checkpoint's trainer state, with the schedule's total (schedule.json: once fixed by the
    budget, it records the step time that fixed it)."""
    path = out / "checkpoints" / f"step_{step:08d}"
    assert verify(path) is None, f"{path}: {verify(path)}"
    schedule = json.loads((path / "schedule.json").read_text())
    fixed = schedule["budget_step_seconds"] is not None
    return {**json.loads((path / "trainer_state.json").read_text()),
            "total_steps": schedule["total_steps"] if fixed else None}


def _stopped_at(text: str) -> int:
    return int(text.split("stopped by a signal at step ")[1].split(":")[0])


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    """A 2-process budget run stopped by SIGTERM (to torchrun, which forwards it) as soon as
    the budget is fixed, then continued with --resume auto to its end.  Its rank 1 starts the
    budget clock 5 s early (tests/budget_skew_entry.py): the ranks' clocks disagree."""
    root = tmp_path_factory.mktemp("budget")
    out = root / "run"
    first = Run(_torchrun("tests.budget_skew_entry", *BUDGET_TRAIN, "--output-dir", str(out)),
                root / "first.log", BUDGET_SKEW_SECONDS="5")
    try:
        record = wait_until(lambda: _budget_records(out), "the budget record", first)[0]
        first.proc.send_signal(signal.SIGTERM)
        first.wait()
        logs = [(out / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
        assert all("stopped by a signal at step " in log for log in logs), first.output[-3000:]
        stops = [_stopped_at(log) for log in logs]
        announced = [_announced(out, r) for r in (0, 1)]
        stopped_state = _state(out, stops[0])
        second = Run(_torchrun("accel_train", *BUDGET_TRAIN, "--output-dir", str(out),
                               "--resume", "auto"), root / "second.log")
        try:
            output = second.check()
        finally:
            second.close()
    finally:
        first.close()
    return SimpleNamespace(out=out, record=record, stops=stops, announced_before=announced,
                           stopped_state=stopped_state, resumed_output=output)


@pytest.mark.slow
def test_two_processes_agree_on_one_step_count(stopped_and_resumed):
    run = stopped_and_resumed
    total = run.record["total_steps"]
    assert run.record["step"] == _window_end(run.record["pilot_step_seconds"]), run.record
    assert total > run.record["step"], run.record
    assert run.announced_before == [[total], [total]], "the ranks announced other counts"
    assert run.stops[0] == run.stops[1], run.stops
    assert run.stops[0] < total, f"the run ended ({total} steps) before the stop"
    assert run.stopped_state["total_steps"] == total
    assert run.stopped_state["step"] == run.stops[0]
    # the final evaluation (--eval-every 0: none measured before it), from the probe: the 64
    # held-out images, one view each, the 2 ranks evaluating a batch of 16 each at once
    assert run.record["epoch_end_seconds"] is None, run.record
    assert run.record["epoch_end_budgeted"] == round(
        64 * run.record["eval_probe_seconds"] / (16 * 2), 3), run.record


@pytest.mark.slow
def test_a_resumed_budget_run_keeps_its_step_count_and_ends_there(stopped_and_resumed):
    run, out = stopped_and_resumed, stopped_and_resumed.out
    total, stop = run.record["total_steps"], run.stops[0]
    assert f"resumed from {out}/checkpoints/step_{stop:08d} at step {stop}" in run.resumed_output
    assert "time budget" not in run.resumed_output, "measured again after the resume"
    assert _budget_records(out) == [run.record], "a second budget record"
    assert [_announced(out, r) for r in (0, 1)] == [[total], [total]]
    assert max(checkpoint_steps(out)) == total
    final = _state(out, total)
    assert (final["step"], final["total_steps"]) == (total, total)
    for step in checkpoint_steps(out):
        if step >= run.record["step"]:
            assert _state(out, step)["total_steps"] == total, step
    train_steps = [r["step"] for r in metrics(out) if r["type"] == "train"]
    assert train_steps == list(range(1, total + 1)), train_steps
    resumed_records = sorted(out.glob("config.resume-*.yaml"))
    assert resumed_records
    assert yaml.safe_load(resumed_records[-1].read_text())["resolved"]["total_steps"] == total


@pytest.mark.slow
def test_config_yaml_records_the_step_count_the_budget_fixed(stopped_and_resumed):
    """config.yaml's resolved facts are what ran: the budget's total, not the provisional
    --epochs count the run started with before it had measured."""
    run = stopped_and_resumed
    resolved = yaml.safe_load((run.out / "config.yaml").read_text())["resolved"]
    assert resolved["total_steps"] == run.record["total_steps"], resolved["total_steps"]


def test_the_budget_replaces_epochs_even_when_they_are_fewer_than_the_measured_steps(tmp_path,
                                                                                     clock):
    """128 images at batch 16 with epochs 1 (from a --config file) is 8 steps, fewer than the
    13 the budget on the command line needs to measure: the run must still measure and fit the
    budget (it replaces the epochs), not end after 8 steps as if no budget had been given.
    (The budget's clock is the fake one, moved 1 s a step by a callback: the run is in this
    process and takes no real 20 s.)"""
    out = tmp_path / "run"
    (tmp_path / "one_epoch.yaml").write_text("epochs: 1\n")
    command = [*[a for a in TINY_TRAIN if a not in ("--synthetic-train-size", "256", "--epochs",
                                                    "1")],
               "--config", str(tmp_path / "one_epoch.yaml"), "--synthetic-train-size", "128",
               "--time-budget", "20s", "--log-every", "1", "--output-dir", str(out)]
    tick = ticking(clock)
    accel_train_here(*command, check=True, callbacks=tick)
    records = _budget_records(out)
    assert len(records) == 1, "no step count was fixed: the budget was ignored"
    train_steps = [r["step"] for r in metrics(out) if r["type"] == "train"]
    # 13 s measured, 7 s left.  The epoch end at step 8 took no time on this clock (it moves
    # with micro-batches only), and a measured epoch end replaces the estimate: 7 more steps
    # (the re-fits, every step, read the same pace and change nothing)
    assert records[0]["epoch_end_seconds"] == 0.0
    assert train_steps[-1] == records[0]["total_steps"] == 20


@pytest.mark.slow
def test_ranks_pace_a_warmup_share_alike_when_their_clocks_start_apart(stopped_and_resumed):
    """The estimates of the length (from the pilot's first step, and from the pilot when a
    longer window follows), which pace a --warmup-fraction warmup until the count is fixed, are
    rank 0's on both ranks: with rank 1's clock 5 s ahead its own would be shorter, and the
    ranks would train at different learning rates."""
    logs = [(stopped_and_resumed.out / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    paced = [PACED.findall(log) for log in logs]
    assert paced[0] and paced[0][0][0] == "4" and paced[0] == paced[1], paced


@pytest.mark.slow
def test_ranks_agree_on_the_step_count_when_their_clocks_start_apart(stopped_and_resumed):
    """The fixture's run starts rank 1's budget clock 5 s before rank 0's (as when rank 0 comes
    to the first step late, after writing the run's records alone): one step count still, on
    both ranks, and together (after the resume) they train exactly that many steps."""
    run = stopped_and_resumed
    total = run.record["total_steps"]
    assert run.announced_before[0] == run.announced_before[1] == [total], run.announced_before
    assert max(checkpoint_steps(run.out)) == total
    assert _state(run.out, total)["total_steps"] == total


# -- the evaluation probe -------------------------------------------------------------------------

class _Recorder(torch.nn.Module):
    """Sleeps `delays` in turn at each forward (the oracle of the time) and records what each
    forward saw: its own and its BatchNorm's train flag, autocast, gradients, memory format and
    batch size."""

    def __init__(self, delays):
        super().__init__()
        self.norm, self.delays, self.seen = torch.nn.BatchNorm2d(3), list(delays), []

    def forward(self, images):
        import time
        self.seen.append({"training": self.training, "norm_training": self.norm.training,
                          "autocast": torch.is_autocast_enabled("cpu"),
                          "grad": torch.is_grad_enabled(), "images": len(images),
                          "channels_last": images.is_contiguous(
                              memory_format=torch.channels_last)})
        time.sleep(self.delays.pop(0))
        return self.norm(images).flatten(1)


class _HeldOut(torch.utils.data.Dataset):
    """10 held-out samples (image, label, replaced mark) that count how they are read; with
    `batched`, through __getitems__ as the trainer's HeldOutImages (the loader's fast path)."""

    def __init__(self, batched: bool):
        self.images, self.reads = torch.rand(10, 3, 8, 8), []
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self):
        return 10

    def __getitem__(self, index):
        self.reads.append(index)
        return self.images[index], index % 3, -1

    def _getitems(self, indices):
        from accel_train.data.loaders import SampleBatch
        self.reads.append(list(indices))
        return SampleBatch(self.images[indices], torch.tensor(indices) % 3,
                           replaced=torch.full((len(indices),), -1))


def _accelerator(precision: str):
    from accelerate import Accelerator
    return Accelerator(cpu=True, mixed_precision=precision)


def test_the_probe_times_the_faster_of_two_held_out_batches_under_the_runs_autocast(
        fresh_accelerate):
    from accel_train.train.evaluate import batch_seconds
    model = _Recorder([0.3, 0.3, 0.05, 0.05])  # the first batch pays for new kernels
    model.train()
    model.norm.eval()  # a frozen backbone's BatchNorm: eval inside a training model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held_out, accelerator = _HeldOut(batched=True), _accelerator("bf16")
    rng = torch.get_rng_state()
    seconds, images = batch_seconds(accelerator, model, held_out, 4, channels_last=True,
                                    tta="flip")
    assert images == 4 and held_out.reads == [[0, 1, 2, 3]] * 2  # the first batch, read twice
    assert 0.1 <= seconds < 0.5, seconds  # the second batch's two views: 2 x 0.05 s
    assert model.seen == [{"training": False, "norm_training": False, "autocast": True,
                           "grad": False, "images": 4, "channels_last": True}] * 4
    assert (model.training, model.norm.training) == (True, False)  # as they were
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())  # nothing drawn


def test_the_probe_normalizes_kept_uint8_pixels_before_the_model_sees_them(fresh_accelerate):
    """Where the held-out batches are kept (uint8 pixels, normalized on the device at each
    evaluation), the probe times that normalization too, before the memory format is set."""
    from accel_train.train.evaluate import batch_seconds
    model, held_out = _Recorder([0.0, 0.0]), _HeldOut(batched=True)
    held_out.images = (held_out.images * 255).to(torch.uint8)
    finished = []

    def finish(pixels):
        finished.append(pixels.dtype)
        return pixels.float() / 255

    batch_seconds(_accelerator("no"), model, held_out, 4, channels_last=True, tta="none",
                  finish=finish)
    assert finished == [torch.uint8] * 2
    assert [(seen["images"], seen["channels_last"]) for seen in model.seen] == [(4, True)] * 2


def test_the_probe_reads_a_held_out_set_smaller_than_a_batch_item_by_item(fresh_accelerate):
    from accel_train.train.evaluate import batch_seconds
    model, held_out = _Recorder([0.0, 0.0]), _HeldOut(batched=False)
    seconds, images = batch_seconds(_accelerator("no"), model, held_out, 64,
                                    channels_last=False, tta="none")
    assert images == 10 and held_out.reads == list(range(10)) * 2
    assert [(seen["autocast"], seen["channels_last"], seen["images"]) for seen in model.seen] \
        == [(False, False, 10)] * 2


def test_the_probe_replaces_the_estimate_until_an_epoch_end_is_measured(clock):
    # a batch of 32 images (16 on each of 2 ranks) in 0.4 s: 1,000 image passes cost 12.5 s,
    # whatever the step time (the estimate from it would be 1000 * 0.5 * 2 / 64 = 15.6 s)
    timer = TimeBudget(100)
    assert timer.evaluation_seconds(1000, 2.0, 64) == pytest.approx(15.625)
    timer.eval_probe(0.4, 32)  # 16 images a rank, one view each
    assert timer.evaluation_seconds(1000, 2.0, 64) == pytest.approx(12.5)
    assert timer.evaluation_seconds(1000, 0.1, 64) == pytest.approx(12.5)
    with timer.paused():
        clock.now += 3.0
    assert timer.evaluation_seconds(1000, 2.0, 64) == 3.0  # measured: it wins


def test_the_probes_seconds_are_left_out_of_the_window_being_timed(clock):
    timer = TimeBudget(100)
    timer.start(0)
    for step in range(1, budget.WARM_STEPS + 2):
        clock.now += 1.0
        reading = timer.measure(step)
        assert (reading is None) == (step <= budget.WARM_STEPS), step
    assert not timer.settle(reading)  # the pilot's first step: an estimate, then on
    with timer.aside():
        clock.now += 7.0
    for step in range(budget.WARM_STEPS + 2, budget.WARM_STEPS + budget.MEASURED_STEPS + 1):
        clock.now += 1.0
        reading = timer.measure(step)
    assert reading == 1.0
    assert timer.seconds - (clock.now - timer.started) == 100 - 20  # the budget's clock ran on


@pytest.mark.parametrize("tta, probe, total", [("none", 0.5, 37), ("none", 2.0, 28),
                                                ("flip", 0.5, 34)])
def test_the_probed_evaluation_sets_the_step_count(tmp_path, monkeypatch, clock, tta, probe,
                                                   total):
    """40 s at 1 s a step on the fake clock, only the final evaluation (64 images, batches of
    16).  The probe at step 13 spends two batches of the budget; then the fit.  Probed at 0.5 s
    a batch: 26 s left, the evaluation 2 s: 37 steps (24 s + 2 s); at 2 s a batch: 23 s left,
    the evaluation 8 s: 28 steps (15 s + 8 s); with --tta flip each image is seen twice, a
    batch takes 1 s: 25 s left, the evaluation 4 s: 34 steps.  The probe's seconds are left out
    of the steps' windows: every re-fit still reads 1 s a step."""
    from accel_train.train import evaluate
    monkeypatch.setattr(evaluate, "batch_seconds", fake_probe(probe, clock))
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "40s",
               "--eval-every", "0", "--tta", tta, "--output-dir", str(out)]
    tick = ticking(clock)
    said = accel_train_here(*command, check=True, callbacks=tick).stdout
    fits = _budget_records(out)
    views = {"none": 1, "flip": 2}[tta]
    evaluation = 64 * views * probe / 16
    assert (fits[0]["step"], fits[0]["total_steps"]) == (13, total), fits[0]
    assert fits[0]["eval_probe_seconds"] == probe * views
    assert fits[0]["epoch_end_budgeted"] == evaluation
    assert total == _largest_that_fits(40, 13 + 2 * probe * views, 1.0, 13, 16, 64, 16,
                                       eval_seconds=evaluation, eval_every=0)
    assert [fit["step_seconds"] for fit in fits] == [1.0] * len(fits)
    assert max(r["step"] for r in metrics(out) if r["type"] == "epoch") == total
    # the first fit, said once: the steps, the epochs they make (16 steps each), the pace
    assert said.count(f"time budget 40s: {total} steps, {total / 16:.1f} epochs at 1000 "
                      f"ms/step (every evaluation included; fitted again as the run goes)") \
        == 1, said


def test_a_budget_spent_before_its_first_fit_ends_the_run_there_and_keeps_it(tmp_path, clock):
    """10 s at 1 s a step on the fake clock: the pilot's 13 steps already spend it.  The run
    ends at step 13 with a warning (it had stopped in one line, exit 2, after training, its
    folder holding checkpoints and no model, and the same command then refused the folder):
    evaluated, checkpointed at step 13 mid-epoch, its model saved, exit 0."""
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "10s",
               "--output-dir", str(out)]
    result = accel_train_here(*command, check=True, callbacks=ticking(clock))
    assert "warning: --time-budget 10s: an optimizer step takes 1.00s here, and the budget " \
           "leaves no time for more than the 13 steps measured: the run ends there" \
           in result.stdout + result.stderr, result.stdout
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert [(r["step"], "eval_top1" in r) for r in epochs] == [(13, True)], epochs
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000013"]


def test_a_budgeted_run_that_max_steps_ends_before_any_fit_records_its_length(tmp_path, clock):
    """--max-steps 4 ends the run inside the pilot, before the budget fixes a count: config.yaml
    records the 4 steps it had (it recorded null), as the schedule in its checkpoint does."""
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "60s",
               "--max-steps", "4", "--output-dir", str(out)]
    accel_train_here(*command, check=True, callbacks=ticking(clock))
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert resolved["total_steps"] == 4 and not _budget_records(out)


def test_a_budgeted_run_plans_only_the_evaluations_eval_every_will_run(tmp_path, clock):
    """1 s a step on the fake clock, 40 s, 16 steps an epoch, an evaluation estimated at 2 s (64
    images at half a step's cost per 16).  The first fit, at step 13 (27 s left): with every
    epoch evaluated, 34 steps (21 s + the ends of epochs 1-3, 6 s: the test above); with
    --eval-every 0 only the final evaluation is to come: 38 steps (25 s + 2 s)."""
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "40s",
               "--eval-every", "0", "--log-every", "1", "--output-dir", str(out)]
    tick = ticking(clock)
    accel_train_here(*command, check=True, callbacks=tick)
    fits = _budget_records(out)
    assert (fits[0]["step"], fits[0]["total_steps"]) == (13, 38), fits[0]
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert ["eval_top1" in r for r in epochs] == [False, False, True], epochs
    assert epochs[-1]["step"] == fits[-1]["total_steps"]


def _lr_by_hand(step: int, warmup: int, fits: list[dict], peak: float) -> float:
    """The learning rate after optimizer step `step` (the next update's), from the fits
    recorded in metrics.jsonl: warmup, then from each fit a cosine from the factor it recorded
    down to zero at its total."""
    if step < warmup:
        return peak * (step + 1) / warmup
    fit = [f for f in fits if f["step"] <= step][-1]
    start = max(warmup, fit["step"])
    progress = min(1.0, (step - start) / max(1, fit["total_steps"] - start))
    return peak * fit["lr_factor"] * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.slow
def test_a_load_that_goes_away_is_followed_and_the_run_ends_on_its_budget(tmp_path, clock):
    """Another job holds the cores for the first 20 steps (1 s a step on the fake clock), then
    leaves (0.5 s a step).  The first fit, at step 13 and 1 s a step, plans 34 steps of the 40 s
    (21 s, and three evaluations estimated at 2 s: 64 images at half a step's cost per 16); the
    re-fits follow the new pace (and the epoch ends measured: no time on this clock), and the
    run ends on its 40 s, not after the 34 steps (at 27 s) the first fit planned.  The learning
    rate never jumps: each fit continues the cosine from where it stood (checked against the
    formula, from the fits metrics.jsonl recorded)."""
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "40s",
               "--log-every", "1", "--output-dir", str(out)]

    tick = ticking(clock, lambda step: 1.0 if step <= 20 else 0.5)
    accel_train_here(*command, check=True, callbacks=tick)
    fits = _budget_records(out)
    train = [r for r in metrics(out) if r["type"] == "train"]
    assert (fits[0]["step"], fits[0]["total_steps"], fits[0]["step_seconds"]) == (13, 34, 1)
    assert len(fits) > 2 and fits[-1]["step_seconds"] == 0.5
    assert train[-1]["step"] == fits[-1]["total_steps"] > 34
    # 20 steps of 1 s, then 0.5 s each: the budget's 40 s end within a step of the last
    ended = 20 + 0.5 * (train[-1]["step"] - 20)
    assert 40 - 0.5 < ended <= 40, ended

    warmup, peak = 16, 0.05  # 1 epoch of 256 / 16; the default peak
    for step in range(1, train[-1]["step"]):
        logged = [r["lr"] for r in train if r["step"] == step][0]
        assert logged == pytest.approx(_lr_by_hand(step, warmup, fits, peak), rel=1e-6), step
    for before, fit in zip(fits, fits[1:]):  # continuity: each fit starts where the last stood
        if fit["step"] >= warmup:
            assert peak * fit["lr_factor"] == pytest.approx(
                _lr_by_hand(fit["step"], warmup, [before], peak), rel=1e-6), fit


def _slow_machine_run(tmp_path, clock, *warmup: str):
    """130 s at 1 s a step on the fake clock (256 images at 16: 16 steps an epoch), only the
    final evaluation (64 images, estimated at 2 s): the pilot (steps 3-13) reads 1 s a step and
    estimates 128 steps (115 s + 2 s after step 13); a second window (8% of 130 s: 11 steps,
    after 2%: 3) fixes the count at step 27: 128 again (101 s + 2 s)."""
    out = tmp_path / "run"
    command = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "130s",
               "--eval-every", "0", "--lr-decay", "linear", "--log-every", "1",
               "--output-dir", str(out), *warmup]
    tick = ticking(clock)
    output = accel_train_here(*command, check=True, callbacks=tick).stdout
    fits = _budget_records(out)
    assert [(f["step"], f["total_steps"]) for f in fits] == [(27, 128)], fits
    train = {r["step"]: r["lr"] for r in metrics(out) if r["type"] == "train"}
    assert max(train) == 128
    return output, fits, train


@pytest.mark.slow
def test_a_warmup_share_follows_the_budget_on_a_slow_machine(tmp_path, clock):
    """--warmup-fraction 0.3: the estimate from the pilot's first step (128 steps) makes the
    warmup 38 steps, rising from update 4 (the rate still ~0: the warmup of the open-ended run
    is as long as it) to the peak at update 37, held at 38, then the line down to 0 at 128
    (np.interp through those corners); the pilot's estimate and the fit at step 27 keep that
    line."""
    output, fits, train = _slow_machine_run(tmp_path, clock, "--warmup-fraction", "0.3")
    assert fits[0]["warmup_steps"] == 38
    peak = 0.05
    # the rate logged after update s is the one update s (0-based) uses
    expected = {s: peak * float(np.interp(s, [4, 37, 38, 128], [0.0, 1.0, 1.0, 0.0]))
                for s in range(1, 129)}
    assert train == pytest.approx(expected, abs=1e-9)
    assert "warning" not in output


@pytest.mark.slow
def test_a_warmup_in_epochs_longer_than_the_budget_is_warned_of(tmp_path, clock):
    """--warmup-epochs 10 is 160 steps, more than the 128 that fit: the rate would rise to the
    end and never come down; the run says so, naming --warmup-fraction.  The rise: over 160
    steps until the first estimate (128 steps, from the pilot's first step) at step 4 (5/160 of
    the peak there), then on from that rate to the peak at the last update, 127; the pilot's
    estimate and the fit at step 27 keep that line (the old rule redrew it over 128 steps from
    the start at each: 28/128 at 27)."""
    output, fits, train = _slow_machine_run(tmp_path, clock, "--warmup-epochs", "10")
    assert "--warmup-epochs 10 is 160 steps" in output and "--warmup-fraction" in output
    peak = 0.05
    expected = {s: peak * ((s + 1) / 160 if s < 4 else
                           float(np.interp(s, [4, 127], [5 / 160, 1.0])))
                for s in range(1, 128)}
    assert {s: train[s] for s in expected} == pytest.approx(expected, abs=1e-9)
    assert train[128] == pytest.approx(peak, abs=1e-9)  # the peak at the last step
