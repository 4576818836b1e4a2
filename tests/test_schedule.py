"""The learning-rate schedule against numbers worked out by hand (not against `lr_factor`).

The schedule (accel_train/train/optim.py): linear warmup over W optimizer steps, then cosine decay
to 0 at the last step T, stepped once per optimizer step.  The update with 0-based index k uses

    lr_k = peak * (k + 1) / W                                for k < W
    lr_k = peak * 0.5 * (1 + cos(pi * min(1, (k - W) / (T - W))))   for k >= W

Every expected value below is a literal with the formula it came from; cos values used:
cos(pi/8) = 0.9238795325, cos(pi/4) = 0.7071067812, cos(3pi/8) = 0.3826834324,
cos(15pi/16) = -0.9807852804.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel_train.config import TrainConfig
from accel_train.train.optim import Schedule, long_warmup_warning, plan_schedule, scheduler_for
from accel_train.run.track import read_metrics

from conftest import TINY_TRAIN, accel_train_here

TOL = 1e-9


def _lrs_per_update(warmup: int, total: int, updates: int, peak: float = 0.1,
                    groups: int = 1) -> list[list[float]]:
    """The lr of every param group at each update, stepping the scheduler once per update as the
    trainer does (optimizer.step(), then scheduler.step())."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(groups)]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=peak)
    scheduler = scheduler_for(optimizer, Schedule(warmup, total))
    seen = []
    for _ in range(updates):
        seen.append([g["lr"] for g in optimizer.param_groups])
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_then_cosine_hand_computed():
    # peak 0.1, warmup W = 4, total T = 20 (decay over T - W = 16 steps)
    lrs = [row[0] for row in _lrs_per_update(warmup=4, total=20, updates=21)]
    expected = {
        0: 0.025,          # warmup start: 0.1 * 1/4
        1: 0.05,           # 0.1 * 2/4
        2: 0.075,          # 0.1 * 3/4
        3: 0.1,            # end of warmup: 0.1 * 4/4
        4: 0.1,            # cosine start: 0.1 * 0.5 * (1 + cos(0))
        8: 0.0853553391,   # 0.1 * 0.5 * (1 + cos(pi * 4/16)) = 0.05 * 1.7071067812
        12: 0.05,          # mid-cosine: 0.1 * 0.5 * (1 + cos(pi * 8/16)) = 0.05 * (1 + 0)
        16: 0.0146446609,  # 0.1 * 0.5 * (1 + cos(pi * 12/16)) = 0.05 * (1 - 0.7071067812)
        19: 0.0009607360,  # last step: 0.1 * 0.5 * (1 + cos(pi * 15/16)) = 0.05 * 0.0192147196
        20: 0.0,           # past the end: 0.1 * 0.5 * (1 + cos(pi)) = 0
    }
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=TOL), (step, lrs[step], value)
    # monotone: up during warmup, never up afterwards
    assert all(a < b for a, b in zip(lrs[:4], lrs[1:4]))
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_every_param_group_follows_the_schedule_and_no_warmup_starts_at_peak():
    # Two groups (as build_optimizer makes: decay / no decay): both get the same factor.
    rows = _lrs_per_update(warmup=0, total=4, updates=5, groups=2)
    expected = [
        0.1,           # no warmup: 0.1 * 0.5 * (1 + cos(0))
        0.0853553391,  # 0.1 * 0.5 * (1 + cos(pi/4))
        0.05,          # 0.1 * 0.5 * (1 + cos(pi/2))
        0.0146446609,  # 0.1 * 0.5 * (1 + cos(3pi/4))
        0.0,           # 0.1 * 0.5 * (1 + cos(pi))
    ]
    for row, value in zip(rows, expected):
        assert row == pytest.approx([value, value], abs=TOL)


@pytest.fixture(scope="module")
def schedule_run(tmp_path_factory):
    """256 images, global batch 16 (8 x 2 accumulation steps): 16 optimizer steps per epoch;
    warmup 0.25 epoch = 4 steps; --max-steps 12 ends (and so shapes) the schedule at 12."""
    out = tmp_path_factory.mktemp("schedule") / "run"
    accel_train_here(*TINY_TRAIN, "--batch-size", "8", "--accumulation-steps", "2", "--lr",
                     "0.1", "--warmup-epochs", "0.25", "--max-steps", "12", "--log-every", "1",
                     "--max-eval-samples", "16", "--output-dir", str(out), check=True)
    return out


def test_cli_run_logs_the_hand_computed_lr(schedule_run):
    train = [m for m in read_metrics(schedule_run / "metrics.jsonl") if m["type"] == "train"]
    assert [m["step"] for m in train] == list(range(1, 13))
    # The lr logged at optimizer step s (after s updates) is the one update s (0-based) will use,
    # peak 0.1, W = 4, T = 12 (decay over 8 steps).  Per optimizer step, not per micro-batch:
    # with 2 accumulation steps a per-micro-batch schedule would be twice as far along.
    expected = {
        1: 0.05,           # 0.1 * 2/4
        2: 0.075,          # 0.1 * 3/4
        3: 0.1,            # end of warmup: 0.1 * 4/4
        4: 0.1,            # 0.1 * 0.5 * (1 + cos(0))
        5: 0.0961939766,   # 0.1 * 0.5 * (1 + cos(pi/8)) = 0.05 * 1.9238795325
        6: 0.0853553391,   # 0.1 * 0.5 * (1 + cos(pi/4))
        7: 0.0691341716,   # 0.1 * 0.5 * (1 + cos(3pi/8)) = 0.05 * 1.3826834324
        8: 0.05,           # mid-cosine: 0.1 * 0.5 * (1 + cos(pi/2))
        9: 0.0308658284,   # 0.1 * 0.5 * (1 - cos(3pi/8))
        10: 0.0146446609,  # 0.1 * 0.5 * (1 - cos(pi/4))
        11: 0.0038060234,  # 0.1 * 0.5 * (1 - cos(pi/8)), the lr of the last update
        12: 0.0,           # after the last update: 0.1 * 0.5 * (1 + cos(pi))
    }
    assert {m["step"]: m["lr"] for m in train} == pytest.approx(expected, abs=TOL)
    assert train[-1]["samples_seen"] == 12 * 16


# -- the shape: --lr-decay, --warmup-start-factor, --final-lr-factor ------------------------------

def _triangle(step: int, warmup: int, total: int, start: float, final: float) -> float:
    """airbench's schedule as it writes it (np.interp through its corners), in this file's
    indexing: update k of warmup uses the factor after k + 1 of W warmup steps; the decay
    runs from the peak at update W to `final` at update T."""
    if step < warmup:
        return float(np.interp(step + 1, [0, warmup], [start, 1.0]))
    return float(np.interp(step, [warmup, total], [1.0, final]))


def test_linear_decay_from_a_warmup_start_to_a_final_factor_is_airbenchs_triangle():
    schedule = Schedule(4, 12, decay="linear", warmup_start=0.2, final_factor=0.07)
    # by hand: 0.2 + 0.8 x 1/4 = 0.4, ..., the peak at update 3 and 4; half-way down
    # (update 8): 0.07 + 0.93 / 2 = 0.535; 0.07 from update 12 on
    assert [schedule.factor(k) for k in (0, 1, 2, 3, 4, 8, 12, 20)] == pytest.approx(
        [0.4, 0.6, 0.8, 1.0, 1.0, 0.535, 0.07, 0.07], abs=TOL)
    assert [schedule.factor(k) for k in range(16)] == pytest.approx(
        [_triangle(k, 4, 12, 0.2, 0.07) for k in range(16)], abs=TOL)


def test_cosine_to_a_final_factor():
    schedule = Schedule(0, 8, final_factor=0.1)
    # 0.1 + 0.9 x 0.5 x (1 + cos(pi k / 8)): k = 0, 2 (cos(pi/4)), 4, 8
    assert [schedule.factor(k) for k in (0, 2, 4, 8, 9)] == pytest.approx(
        [1.0, 0.1 + 0.45 * 1.7071067812, 0.55, 0.1, 0.1], abs=TOL)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_a_decay_of_one_step_ends_at_the_final_factor(decay):
    """A budget fit one step before the end, or warmup to the last step but one: after the
    last update the rate is the final one (what the last log line shows)."""
    schedule = Schedule(3, 4, decay=decay, final_factor=0.07)
    assert [schedule.factor(k) for k in range(5)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 1.0, 0.07], abs=TOL)


def test_a_budget_fit_continues_the_linear_decay_without_a_jump():
    """Fitted at update 6 (of 12) to a total of 20: the decay continues from the factor of
    that moment down to the final one at 20, in a straight line."""
    schedule = Schedule(4, 12, decay="linear", warmup_start=0.2, final_factor=0.07)
    before = schedule.factor(6)              # 1 - 0.93 x 2/8 = 0.7675
    assert before == pytest.approx(0.7675, abs=TOL)
    schedule.fit_total(20, 0.5, 6)
    assert schedule.factor(6) == pytest.approx(before, abs=TOL)
    assert schedule.factor(13) == pytest.approx(0.07 + (0.7675 - 0.07) * 0.5, abs=TOL)
    assert schedule.factor(20) == pytest.approx(0.07, abs=TOL)


def test_cli_run_logs_the_triangle(tmp_path):
    """Through the command line: the logged rates of a 12-step run (warmup 4) are airbench's
    corners, 0.2 -> 1 -> 0.07 of --lr 0.1, drawn by np.interp."""
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--lr", "0.1", "--warmup-epochs", "0.25", "--max-steps", "12",
                     "--lr-decay", "linear", "--warmup-start-factor", "0.2",
                     "--final-lr-factor", "0.07", "--log-every", "1", "--output-dir", str(out),
                     check=True)
    train = [m for m in read_metrics(out / "metrics.jsonl") if m["type"] == "train"]
    # the lr logged after update s is the one update s (0-based) uses
    assert {m["step"]: m["lr"] for m in train} == pytest.approx(
        {s: 0.1 * _triangle(s, 4, 12, 0.2, 0.07) for s in range(1, 13)}, abs=TOL)


# -- --warmup-fraction: the warmup as a share of the run ------------------------------------------

def test_a_warmup_share_refitted_mid_warmup_rises_on_from_where_it_stood():
    """A share of 0.25: warmup 5 of a first fit's 20 steps.  Refitted at update 2 (whose rate
    the scheduler has already set: 0.2 + 0.8 x 3/5 = 0.68) to a total of 40, the warmup ends at
    update 10 (the peak at update 9), the rise going on in a straight line from 0.68:
    0.32 / 7 a step.  No jump, and the decay then runs from the peak at 10 down to 0.07 at 40."""
    schedule = Schedule(5, 20, decay="linear", warmup_start=0.2, final_factor=0.07,
                        warmup_fraction=0.25)
    assert [schedule.factor(k) for k in range(3)] == pytest.approx([0.36, 0.52, 0.68], abs=TOL)
    schedule.fit_total(40, 0.5, 2)
    assert schedule.warmup_steps == 10
    assert [schedule.factor(k) for k in (2, 3, 5, 9, 10, 25, 40)] == pytest.approx(
        [0.68, 0.68 + 0.32 / 7, 0.68 + 3 * 0.32 / 7, 1.0, 1.0, 0.07 + 0.93 * 0.5, 0.07],
        abs=TOL)


def test_a_warmup_share_refitted_behind_its_step_ends_the_warmup_there():
    """Refitted at update 4 (0.2 + 0.8 x 5/10 = 0.6) to a total of 8 (a share of 0.25: 2
    steps, already behind): no peak is reached; the decay goes on from 0.6 down to 0.07 at 8:
    0.53 / 4 a step."""
    schedule = Schedule(10, 40, decay="linear", warmup_start=0.2, final_factor=0.07,
                        warmup_fraction=0.25)
    schedule.fit_total(8, 0.5, 4)
    assert [schedule.factor(k) for k in (4, 5, 6, 8, 9)] == pytest.approx(
        [0.6, 0.6 - 0.1325, 0.6 - 0.265, 0.07, 0.07], abs=TOL)


def test_an_estimate_paces_a_warmup_share_without_fixing_the_total():
    """The budget's pilot (step_seconds None): the warmup follows the estimate; the total stays
    open and nothing is recorded as fitted."""
    schedule = Schedule(10**11, 10**12, warmup_fraction=0.5)
    schedule.fit_total(20, None, 4)
    assert (schedule.warmup_steps, schedule.total_steps) == (10, 10**12)
    assert not schedule.fixed_by_budget
    # from update 4's factor (5 / 10^11, ~0) to the peak at update 9: 1/5 a step
    assert schedule.factor(6) == pytest.approx(2 / 5, abs=1e-6)


def test_a_warmup_in_epochs_is_not_moved_by_a_fit():
    schedule = Schedule(5, 20, decay="linear")
    schedule.fit_total(40, 0.5, 2)
    assert schedule.warmup_steps == 5 and schedule.factor(4) == pytest.approx(1.0, abs=TOL)


def test_a_warmup_in_epochs_longer_than_the_fitted_total_rises_on_without_a_jump(tmp_path):
    """A warmup of 10 steps (in epochs) in a budgeted run, open-ended until fitted.  Fitted at
    update 2 (0.2 + 0.8 x 3/10 = 0.44) to a total of 6, shorter than the warmup: the peak comes
    at update 5, the rise going on from 0.44 (not redrawn from 0.2 over 6 steps: 0.6).  Fitted
    again at update 4 to a total of 8: the rise goes on from where it stood to the peak at
    update 7.  A run resumed from the saved schedule continues the same line."""
    schedule = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    schedule.fit_total(6, 0.5, 2)
    assert [schedule.factor(k) for k in (2, 3, 5)] == pytest.approx(
        [0.44, 0.44 + 0.56 / 3, 1.0], abs=TOL)
    at_4 = 0.44 + 2 * 0.56 / 3
    schedule.fit_total(8, 0.5, 4)
    expected = {k: float(np.interp(k, [4, 7], [at_4, 1.0])) for k in range(4, 8)}
    assert {k: schedule.factor(k) for k in expected} == pytest.approx(expected, abs=TOL)
    schedule.save(tmp_path)
    resumed = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    resumed.load(tmp_path)
    assert {k: resumed.factor(k) for k in expected} == pytest.approx(expected, abs=TOL)
    # a total that grows past the warmup again gives it back its own end: the peak at update 9
    resumed.fit_total(30, 0.5, 6)
    at_6 = at_4 + 2 * (1 - at_4) / 3
    assert [resumed.factor(k) for k in (6, 9, 10, 30)] == pytest.approx(
        [at_6, 1.0, 1.0, 0.0], abs=TOL)


def test_an_estimate_paces_a_warmup_in_epochs_but_does_not_end_it():
    """A warmup of 10 steps, the total open: an estimate of 6 steps at update 2 (0.2 + 0.8 x
    3/10 = 0.44) moves the peak to update 5 (the total stays open); an estimate behind the
    step (3 steps, at update 3) changes nothing: only a fit may end a warmup (one step's
    reading can be far too slow).  The fit at update 4 to a total of 30 gives it back its
    planned end: the peak at update 9."""
    schedule = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    schedule.fit_total(6, None, 2)
    assert (schedule.total_steps, schedule.fixed_by_budget) == (10**12, False)
    at_3 = 0.44 + 0.56 / 3
    assert [schedule.factor(k) for k in (2, 3, 5)] == pytest.approx([0.44, at_3, 1.0], abs=TOL)
    schedule.fit_total(3, None, 3)
    assert [schedule.factor(k) for k in (3, 4, 5)] == pytest.approx(
        [at_3, at_3 + 0.56 / 3, 1.0], abs=TOL)
    at_4 = at_3 + 0.56 / 3
    schedule.fit_total(30, 0.5, 4)
    expected = {k: float(np.interp(k, [4, 9, 10, 30], [at_4, 1.0, 1.0, 0.0]))
                for k in range(4, 31)}
    assert {k: schedule.factor(k) for k in expected} == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("estimate, expected", [
    # two steps ahead of update 3: one update left to rise over, the peak at update 4
    (5, {3: 0.52, 4: 1.0, 5: 1.0}),
    # one step ahead, or behind: no update to rise over; an estimate does not end the warmup,
    # which goes on as planned (0.2 + 0.8 x (k + 1) / 10)
    (4, {3: 0.52, 4: 0.6, 8: 0.92, 9: 1.0}),
    (3, {3: 0.52, 4: 0.6, 8: 0.92, 9: 1.0}),
])
def test_an_estimate_at_the_warmups_last_steps(estimate, expected):
    schedule = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    schedule.fit_total(estimate, None, 3)
    assert {k: schedule.factor(k) for k in expected} == pytest.approx(expected, abs=TOL)


def test_a_run_stopped_during_the_pilot_resumes_on_the_estimates_line(tmp_path):
    """Stopped after an estimate (6 steps, at update 2) and before any fit: schedule.json
    carries the warmup's new line; a schedule built anew from the same flags and loaded
    continues it (the total still open), not the planned rise over 10 (0.2 + 0.8 x 5/10 = 0.6
    at update 4 instead of 0.44 + 2 x 0.56/3)."""
    stopped = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    stopped.fit_total(6, None, 2)
    stopped.save(tmp_path)
    resumed = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    resumed.load(tmp_path)
    assert (resumed.total_steps, resumed.fixed_by_budget) == (10**12, False)
    assert [resumed.factor(k) for k in (2, 4, 5)] == pytest.approx(
        [0.44, 0.44 + 2 * 0.56 / 3, 1.0], abs=TOL)
    # an estimate at the very first update (0.2 + 0.8 x 1/10 = 0.28): the line from there
    stopped = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    stopped.fit_total(5, None, 0)
    stopped.save(tmp_path)
    resumed = Schedule(10, 10**12, decay="linear", warmup_start=0.2)
    resumed.load(tmp_path)
    assert [resumed.factor(k) for k in (0, 2, 4)] == pytest.approx(
        [0.28, 0.28 + 0.72 / 2, 1.0], abs=TOL)
    # a schedule no estimate moved loads as the flags give it, and so does an older version's
    # (no warmup point recorded)
    for saved in (Schedule(10, 10**12), None):
        if saved is None:
            (tmp_path / "schedule.json").write_text(
                '{"warmup_steps": 4, "total_steps": 20, "budget_step_seconds": null}\n')
        else:
            saved.save(tmp_path)
        resumed = Schedule(8, 10**12)
        resumed.load(tmp_path)
        assert resumed.warmup_steps == 8 and resumed.factor(3) == pytest.approx(0.5, abs=TOL)


@pytest.mark.parametrize("seed", range(60))
def test_no_sequence_of_fits_makes_the_rate_jump(seed):
    """Whatever the shape and however the budget's fits come (totals shorter or longer than
    the warmup, behind the step or far ahead, a pilot's estimate first or not), the factor of
    the update a fit happens at is the one the scheduler had already set, the run's factors stay
    within [final, 1], and once the peak has been left the rate never rises again."""
    rng = np.random.default_rng(seed)
    fraction = None if rng.random() < 0.5 else float(rng.uniform(0.05, 0.6))
    schedule = Schedule(int(rng.integers(0, 60)), 10**12,
                        decay=str(rng.choice(["cosine", "linear"])),
                        warmup_start=float(rng.choice([0.0, 0.2])),
                        final_factor=float(rng.choice([0.0, 0.07])), warmup_fraction=fraction)
    fits = sorted(int(k) for k in rng.choice(np.arange(1, 80), size=int(rng.integers(2, 8)),
                                             replace=False))
    estimates = fits[:int(rng.integers(0, 3))]  # the budget's estimates come before its fits
    seen = []
    for step in range(100):
        if step in fits:
            before = schedule.factor(step)
            schedule.fit_total(int(rng.integers(step + 1, step + 80)),
                               None if step in estimates else 0.5, step)
            assert schedule.factor(step) == pytest.approx(before, abs=TOL), (seed, step)
        if step < schedule.total_steps:
            seen.append(schedule.factor(step))
    assert min(seen) >= min(schedule.warmup_start, schedule.final_factor) - TOL
    assert max(seen) <= 1 + TOL
    peak = int(np.argmax(seen))
    assert all(b <= a + TOL for a, b in zip(seen[peak:], seen[peak + 1:])), seed


def test_cli_warmup_fraction_is_a_share_of_the_run(tmp_path):
    """--warmup-fraction 0.25 of a 12-step run (--max-steps) is 3 warmup steps, whatever
    --warmup-epochs says (here 0.25 epochs = 4 steps): the logged rates against np.interp."""
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--lr", "0.1", "--warmup-epochs", "0.25", "--max-steps", "12",
                     "--warmup-fraction", "0.25", "--lr-decay", "linear",
                     "--log-every", "1", "--output-dir", str(out), check=True)
    train = [m for m in read_metrics(out / "metrics.jsonl") if m["type"] == "train"]
    assert {m["step"]: m["lr"] for m in train} == pytest.approx(
        {s: 0.1 * _triangle(s, 3, 12, 0.0, 0.0) for s in range(1, 13)}, abs=TOL)


def test_a_resumed_budget_run_keeps_the_warmup_its_fits_moved(tmp_path):
    """schedule.json carries the moved warmup: a schedule built anew from the same flags (the
    open-ended warmup of a budgeted run) and loaded gives every later update the same rate."""
    fitted = Schedule(10**11, 10**12, decay="linear", warmup_start=0.2, warmup_fraction=0.25)
    fitted.fit_total(40, None, 4)     # the pilot's estimate: warmup 10, from (4, ~0.2)
    fitted.fit_total(60, 0.5, 7)      # the fit: warmup 15, from (7, 0.2 + 0.8 x 3/5 = 0.68)
    assert fitted.factor(7) == pytest.approx(0.68, abs=1e-9)
    fitted.save(tmp_path)
    resumed = Schedule(10**11, 10**12, decay="linear", warmup_start=0.2, warmup_fraction=0.25)
    resumed.load(tmp_path)
    assert (resumed.warmup_steps, resumed.total_steps, resumed.budget_step_seconds) == \
        (15, 60, 0.5)
    # the rise from 0.68 at update 7 to the peak at 14, then the line to 0 at 60
    expected = [float(np.interp(k, [7, 14, 15, 60], [0.68, 1.0, 1.0, 0.0])) for k in range(7, 62)]
    assert [resumed.factor(k) for k in range(7, 62)] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("share, expected", [
    # a new warmup of 8 steps at update 6 (0.2 + 0.8 x 7/10 = 0.76): one more update to rise
    # over, the peak at update 7, the decay from 8 (down to 0 at 32)
    (8, {6: 0.76, 7: 1.0, 8: 1.0, 20: 0.5, 32: 0.0}),
    # 7 steps: no update left to rise over: the warmup ends at 6, the decay goes on from 0.76
    (7, {6: 0.76, 7: 0.76 * 25 / 26, 19: 0.38, 32: 0.0}),
    # 6 steps, already behind: the same
    (6, {6: 0.76, 7: 0.76 * 25 / 26, 19: 0.38, 32: 0.0}),
])
def test_a_warmup_share_fitted_at_its_last_steps(share, expected):
    """The boundaries of a fit during the warmup: the share's new end two, one and no steps
    ahead of the update the fit happens at (a total of 32, shares of 8/32, 7/32, 6/32)."""
    schedule = Schedule(10, 40, decay="linear", warmup_start=0.2, warmup_fraction=share / 32)
    schedule.fit_total(32, 0.5, 6)
    assert {k: schedule.factor(k) for k in expected} == pytest.approx(expected, abs=TOL)


def test_a_fit_at_the_warmups_last_update_does_not_hold_the_peak():
    """Fitted at update 5, the first after a warmup of 5 (its peak at update 4), to a longer
    total: the warmup is over, not extended: the decay starts at once, from the peak."""
    schedule = Schedule(5, 20, decay="linear", warmup_fraction=0.25)
    schedule.fit_total(40, 0.5, 5)
    assert schedule.warmup_steps == 5
    assert [schedule.factor(k) for k in (4, 5, 6, 40)] == pytest.approx(
        [1.0, 1.0, 34 / 35, 0.0], abs=TOL)


def test_a_budget_fit_during_the_decay_is_kept_by_a_resumed_run(tmp_path):
    """Fitted at update 10 of a linear decay (4 warmup steps, total 20: 1 - 6/16 = 0.625) to a
    total of 30: the line from 0.625 at 10 down to 0 at 30; a run resumed from the saved schedule
    continues it (a schedule built from the flags alone would start the decay at the peak)."""
    fitted = Schedule(4, 20, decay="linear")
    fitted.fit_total(30, 0.5, 10)
    fitted.save(tmp_path)
    resumed = Schedule(4, 10**12, decay="linear")
    resumed.load(tmp_path)
    expected = [float(np.interp(k, [10, 30], [0.625, 0.0])) for k in range(10, 32)]
    assert [resumed.factor(k) for k in range(10, 32)] == pytest.approx(expected, abs=TOL)


def test_a_schedule_saved_by_an_older_version_loads_as_it_ran(tmp_path):
    """schedule.json of the versions that fitted once, at the warmup's end, and had no warmup
    share: only the warmup, the total and the step time.  Their decay ran from the peak at the
    warmup's end; a warmup share now asked for keeps the saved warmup's plain line."""
    (tmp_path / "schedule.json").write_text(
        '{"warmup_steps": 4, "total_steps": 20, "budget_step_seconds": 0.5}\n')
    for share in (None, 0.5):
        resumed = Schedule(10**11, 10**12, decay="linear", warmup_fraction=share)
        if share is None:
            resumed.warmup_steps = 4  # from --warmup-epochs, as the flags give it
        resumed.load(tmp_path)
        assert [resumed.factor(k) for k in (0, 3, 4, 12, 20)] == pytest.approx(
            [0.25, 1.0, 1.0, 0.5, 0.0], abs=TOL), share


def test_an_older_versions_schedule_without_warmup_decays_from_the_first_update(tmp_path):
    (tmp_path / "schedule.json").write_text(
        '{"warmup_steps": 0, "total_steps": 20, "budget_step_seconds": 0.5}\n')
    resumed = Schedule(0, 10**12, decay="linear")
    resumed.load(tmp_path)
    assert [resumed.factor(k) for k in (0, 5, 10, 20)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.0], abs=TOL)


@pytest.mark.parametrize("options, steps_per_epoch, warned", [
    ({"epochs": 1, "warmup_epochs": 1}, 10, True),       # warmup 10 of 10 steps: no decay
    ({"epochs": 3, "warmup_epochs": 1}, 10, False),
    ({"epochs": 3, "max_steps": 6, "warmup_epochs": 1}, 10, True),   # 10 of 6
    ({"epochs": 3, "max_steps": 11, "warmup_epochs": 1}, 10, False),
    ({"epochs": 1, "warmup_epochs": 0.1, "max_steps": 1}, 10, True),  # "1 step"
    ({"epochs": 1, "warmup_epochs": 0}, 10, False),
    ({"epochs": 1, "warmup_fraction": 0.5}, 10, False),  # a share always leaves a decay
    ({"epochs": 1, "warmup_epochs": 5, "time_budget": "60s"}, 10, False),  # pacing.py warns
])
def test_a_warmup_as_long_as_the_run_is_warned_of(options, steps_per_epoch, warned):
    config = TrainConfig.from_dict(options, source="test")
    words = long_warmup_warning(config, plan_schedule(config, steps_per_epoch))
    assert (words is not None) == warned, words
    if warned:
        steps = round(config.warmup_epochs * steps_per_epoch)
        assert words.startswith(f"--warmup-epochs {config.warmup_epochs:g} is {steps} "
                                f"step{'' if steps == 1 else 's'}, as many")
        assert "will not come down from its peak" in words
