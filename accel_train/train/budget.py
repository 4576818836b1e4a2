"""--time-budget: fit the whole schedule (warmup and decay to the end) into a wall-clock budget,
and keep fitting it as the run goes.

The run trains a few steps (past compilation and warm caches), measures the time an optimizer
step takes (a short pilot, then a window of a few percent of the budget), and fixes the number
of steps so that training and every evaluation at an epoch end, the final one included, fit
the budget: "Training took" is read against the number the user gave.  A machine's speed is not
steady (another job on the same cores, for a minute or for the rest of the run), so the count is
fitted again each time REFIT_FRACTION of the budget has passed, from the time left and the steps
of that latest window; an epoch end's cost is measured too, and replaces the estimate.  Every
rank agrees on the slowest rank's reading, rank 0 decides the count, and each fit is recorded in
metrics.jsonl and in the checkpoints (the schedule), so a resumed run continues the plan it was
on.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Optional


WARM_STEPS = 3       # not measured: the first steps pay compilation, allocation, cold caches
MEASURED_STEPS = 10  # then this many are timed: the pilot reading
# The pilot's first step alone already gives an estimate of the length, which paces the warmup
# (nothing is fixed by it): on a slow machine ten steps are a large share of a short budget,
# and a warmup paced only at the pilot's end stays at its start all that time.
GLIMPSE_STEPS = 1
# A CPU keeps speeding up for far longer than three steps (allocator, oneDNN caches, the OS
# scheduler settling): a pilot of ten steps reads slow, and a schedule fitted to it ends early
# (BENCHMARKS.md, "The recipe file with --time-budget").  So, unless the budget is short, the
# pilot only sizes a second window in steps (all ranks size it alike from the agreed pilot),
# which waits SETTLE_FRACTION of the budget and then times MEASURE_FRACTION of it: long enough
# that a passing slowdown of a shared machine moves the reading little (a shorter window
# mistook one slow minute for the run's speed).  Until the count is fixed the schedule is
# warmup, then its peak; the decay spans the rest.
SETTLE_FRACTION = 0.02
MEASURE_FRACTION = 0.08
# Once fixed, the count is fitted again after each window of this share of the budget (sized in
# steps at the latest agreed pace, so that all ranks fit at the same step): a slowdown or a
# speed-up is followed within seconds, and the last fits, close to the end, leave little to
# predict.
REFIT_FRACTION = 0.02
# A fit that moves the count by this share is said on the console; every fit that changes it is
# in metrics.jsonl.
SAY_REFIT_FRACTION = 0.05
# Until an evaluation has been timed (`eval_probe`: one held-out batch) or an epoch
# end measured, an image's evaluation pass is estimated at half of training on it: forward
# only costs about a third, but how much less depends on the machine (measured: about a third
# with native bf16, a quarter to a third in fp32 on AVX2), so the probe replaces it.
EVAL_COST_PER_IMAGE = 0.5

# Forward passes over each held-out image per evaluated model, by --tta (evaluate.logits_of).
TTA_PASSES = {"none": 1, "flip": 2, "flip-translate": 6}


def evaluation_passes(model_ema: bool, tta: str) -> int:
    """Forward passes over each held-out image at an epoch end: the raw model and (--model-ema)
    the EMA, each image as many times as --tta views it (counting one pass where flip TTA makes
    two overran the budget: BENCHMARKS.md)."""
    return (2 if model_ema else 1) * TTA_PASSES[tta]


def epoch_ends_to_come(ended: int, last: int, eval_every: int) -> tuple[int, int]:
    """Of the epoch ends after the first `ended` up to epoch `last` (1-based), how many there
    are and how many evaluate: each multiple of `eval_every` (0: none) and the last."""
    if last <= ended:
        return 0, 0
    multiples = last // eval_every - ended // eval_every if eval_every else 0
    return last - ended, multiples + (1 if not eval_every or last % eval_every else 0)


class TimeBudget:
    """Times windows of optimizer steps: a pilot after WARM_STEPS, maybe a longer window, then
    one window after another for the re-fits; and the cost of each epoch end."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started, self.first_step = time.perf_counter(), 0
        self._window = (WARM_STEPS, WARM_STEPS + GLIMPSE_STEPS)  # in steps since the start
        self._window_start: Optional[tuple[int, float]] = None
        self._last_reading: Optional[tuple[int, float]] = None  # where the last window ended
        self._paused = 0.0  # seconds spent in `paused()` so far
        self.glimpse_seconds: Optional[float] = None
        self.pilot_seconds: Optional[float] = None
        self.step_seconds: Optional[float] = None  # the latest agreed reading, once fitted
        self.epoch_end_seconds: Optional[float] = None  # the latest epoch end's cost
        self._epoch_ends: list[float] = []  # every evaluating epoch end's cost, measured
        self._plain_ends: list[float] = []  # and of those --eval-every skipped
        self.eval_probe_seconds: Optional[float] = None  # the probe's batch, agreed
        self.eval_image_seconds: Optional[float] = None  # one image's evaluation pass, probed
        self.fits = 0

    def start(self, step: int) -> None:
        """Training starts (or resumes, unmeasured) at optimizer step `step`: the clock runs."""
        self.started, self.first_step = time.perf_counter(), step

    @contextlib.contextmanager
    def paused(self, evaluates: bool = True):
        """An epoch end (an evaluation, unless --eval-every skips this one, and a checkpoint):
        the clock of the budget runs on, but a window being timed leaves it out (a window that
        held an epoch end read far too slow); its cost is measured instead, for the epoch ends
        still to come (those that evaluate apart from those that do not)."""
        began = time.perf_counter()
        try:
            with self.aside():
                yield
        finally:
            seconds = time.perf_counter() - began
            (self._epoch_ends if evaluates else self._plain_ends).append(seconds)
            if evaluates:
                self.epoch_end_seconds = seconds

    @contextlib.contextmanager
    def aside(self):
        """Work between steps that is not training (the evaluation probe, an epoch end): the
        clock of the budget runs on, but the window of steps being timed leaves it out."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began

    def measure(self, step: int) -> Optional[float]:
        """Call after each optimizer step; the seconds per step over the current window once it
        is complete (then hand the ranks' agreed value to `settle`), else None."""
        now, steps_done = time.perf_counter(), step - self.first_step
        now -= self._paused  # the clock of steps alone
        begin, end = self._window
        if self._window_start is None:
            if steps_done >= begin:
                self._window_start = (steps_done, now)
            return None
        first_step, first_time = self._window_start
        if steps_done < end:
            return None
        self._last_reading = (steps_done, now)
        return (now - first_time) / (steps_done - first_step)

    def settle(self, step_seconds: float) -> bool:
        """The ranks' agreed reading of the window just completed.  True: fit the count now;
        False: an estimate only (the pilot's first step, or the pilot when a longer window
        follows)."""
        if self.glimpse_seconds is None:
            # The pilot times on from the same start, to its end.
            self.glimpse_seconds = step_seconds
            self._window = (WARM_STEPS, WARM_STEPS + MEASURED_STEPS)
            return False
        if self.pilot_seconds is None:
            self.pilot_seconds = step_seconds
            end = self._window[1]
            wait = math.ceil(SETTLE_FRACTION * self.seconds / step_seconds)
            length = math.ceil(MEASURE_FRACTION * self.seconds / step_seconds)
            if length > MEASURED_STEPS:  # else the pilot is as long as a second window would be
                self._window, self._window_start = (end + wait, end + wait + length), None
                return False
        self.step_seconds = step_seconds
        # The next window starts where this one ended, and is as long in steps on every rank.
        steps_done = self._last_reading[0]
        length = max(1, math.ceil(REFIT_FRACTION * self.seconds / step_seconds))
        self._window, self._window_start = (steps_done, steps_done + length), self._last_reading
        return True

    def eval_probe(self, batch_seconds: float, image_passes: int) -> None:
        """The ranks' agreed (slowest) time of one held-out batch through the evaluation, which
        made `image_passes` passes (images x TTA views x ranks): what an epoch end's evaluation
        is estimated from until one is measured (a run with --eval-every 0 measures none before
        its final evaluation)."""
        self.eval_probe_seconds = batch_seconds
        self.eval_image_seconds = batch_seconds / image_passes

    def evaluation_seconds(self, eval_images: int, step_seconds: float,
                           global_batch: int) -> float:
        """What an epoch end will cost: the median of those measured (one slow end, a disk
        flush or a passing load, must not cut the steps of the rest of the run: seen, one end of
        5.5 s among ends of 3 s made a 180 s run end 3% short), else the probe's pace times the
        passes over the held-out images (`eval_images` counts each pass), else an estimate from
        the training pace."""
        if self._epoch_ends:
            return statistics.median(self._epoch_ends)
        if self.eval_image_seconds is not None:
            return eval_images * self.eval_image_seconds
        return eval_images * EVAL_COST_PER_IMAGE * step_seconds / global_batch

    def plain_end_seconds(self) -> float:
        """What an epoch end without an evaluation costs (a checkpoint): the median of those
        measured, else nothing (the re-fits absorb it)."""
        return statistics.median(self._plain_ends) if self._plain_ends else 0.0

    def total_steps(self, step_seconds: float, steps_done: int, steps_per_epoch: int,
                    eval_images: int, global_batch: int, eval_every: int = 1) -> int:
        """The most steps such that the steps still to come plus the epoch ends still to come
        (those that evaluate: every `eval_every`th and the last, the final evaluation; and the
        others) fit the time that is left.  A fit with no room for a step ends the run where it
        stands (`steps_done`), even the first: by then the run has trained, and its steps are
        kept, evaluated and saved; the pacer warns of it."""
        low = self.steps_that_fit(step_seconds, steps_done, steps_per_epoch, eval_images,
                                  global_batch, eval_every)
        self.fits += 1
        return low

    def steps_that_fit(self, step_seconds: float, steps_done: int, steps_per_epoch: int,
                       eval_images: int, global_batch: int, eval_every: int) -> int:
        """`total_steps`' count, without making it a fit (the pilot's estimate)."""
        left = self.seconds - (time.perf_counter() - self.started)
        eval_seconds = self.evaluation_seconds(eval_images, step_seconds, global_batch)
        plain_seconds = self.plain_end_seconds()
        # Epoch ends already behind us: the one after step `steps_done` is still to come when
        # that step closed its epoch (the fit happens inside the epoch's last step).
        ended = (steps_done - 1) // steps_per_epoch if steps_done > 0 else 0

        def fits(total: int) -> bool:
            last = math.ceil(total / steps_per_epoch)  # a partial epoch ends in one
            ends, evaluations = epoch_ends_to_come(ended, last, eval_every)
            return ((total - steps_done) * step_seconds + evaluations * eval_seconds
                    + (ends - evaluations) * plain_seconds <= left)

        # The time needed grows with the total, so the largest total that fits is found by
        # bisection between "nothing more" and "every second on steps, no evaluations".
        low, high = steps_done, steps_done + max(0, math.floor(left / step_seconds))
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low
