"""--time-budget: fit the whole schedule (warmup and decay to the end) into a wall-clock budget.

The run trains a few steps (past compilation and warm caches), measures the time an optimizer
step takes (a short pilot, then a window of a few percent of the budget), and fixes the number
of steps so that training and every evaluation at an epoch end, the final one included, fit
the budget: "Training took" is read against the number the user gave.  Every rank agrees on the
slowest rank's measurement, and the total is recorded in the checkpoints, so a resumed run keeps
the schedule.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from typing import Optional

from .errors import UsageError

WARM_STEPS = 3       # not measured: the first steps pay compilation, allocation, cold caches
MEASURED_STEPS = 10  # then this many are timed: the pilot reading
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
# Evaluating an image (forward only, no augmentation) costs about a third of training on it;
# half is the estimate, to err on finishing inside the budget.
EVAL_COST_PER_IMAGE = 0.5

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def evaluation_passes(model_ema: bool, tta: str) -> int:
    """Forward passes over each held-out image at an epoch end: the raw model and (--model-ema)
    the EMA, each image once or (--tta flip) twice (counting one pass where flip TTA makes two
    overran the budget: BENCHMARKS.md)."""
    return (2 if model_ema else 1) * (2 if tta == "flip" else 1)


def parse_duration(text: str) -> float:
    """Seconds in "600", "90s", "10m", "1h", "1h30m"; a UsageError naming the flag otherwise."""
    match = _DURATION.match(str(text).strip().lower())
    if not match or not any(match.groups()):
        raise UsageError(f"--time-budget {text!r} is not a duration; write 600, 90s, 10m, 1h or "
                         f"1h30m")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise UsageError(f"--time-budget {text!r} is no time at all; give it minutes, e.g. 10m")
    return total


class TimeBudget:
    """Times windows of optimizer steps: a pilot after WARM_STEPS, then maybe a longer one."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started, self.first_step = time.perf_counter(), 0
        self._window = (WARM_STEPS, WARM_STEPS + MEASURED_STEPS)  # in steps since the start
        self._window_start: Optional[tuple[int, float]] = None
        self._paused = 0.0  # seconds spent in `paused()` so far
        self.pilot_seconds: Optional[float] = None
        self.step_seconds: Optional[float] = None

    def start(self, step: int) -> None:
        """Training starts (or resumes, unmeasured) at optimizer step `step`: the clock runs."""
        self.started, self.first_step = time.perf_counter(), step

    @contextlib.contextmanager
    def paused(self):
        """Work that is not a training step (the epoch-end evaluation and checkpoint): the clock
        of the budget runs on, but a window being timed leaves it out (the evaluations are
        budgeted on their own, and a window that held an epoch end read far too slow)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began

    def measure(self, step: int) -> Optional[float]:
        """Call after each optimizer step; the seconds per step over the current window once it
        is complete (then hand the ranks' agreed value to `settle`), else None."""
        if self.step_seconds is not None:
            return None
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
        return (now - first_time) / (steps_done - first_step)

    def settle(self, step_seconds: float) -> bool:
        """The ranks' agreed reading of the window just completed.  True: it is final (fix the
        schedule now); False: it was the pilot, and a longer window now follows."""
        if self.pilot_seconds is None:
            self.pilot_seconds = step_seconds
            end = self._window[1]
            wait = math.ceil(SETTLE_FRACTION * self.seconds / step_seconds)
            length = math.ceil(MEASURE_FRACTION * self.seconds / step_seconds)
            if length > MEASURED_STEPS:  # else the pilot is as long as a second window would be
                self._window, self._window_start = (end + wait, end + wait + length), None
                return False
        self.step_seconds = step_seconds
        return True

    def total_steps(self, step_seconds: float, steps_done: int, steps_per_epoch: int,
                    eval_images: int, global_batch: int, flag: str) -> int:
        """The most steps such that the steps still to come plus the evaluations at the epoch
        ends, the last (the final evaluation) included, fit the time that is left."""
        left = self.seconds - (time.perf_counter() - self.started)
        eval_seconds = eval_images * EVAL_COST_PER_IMAGE * step_seconds / global_batch

        def fits(total: int) -> bool:
            evaluations = math.ceil(total / steps_per_epoch)  # a partial last epoch ends in one
            return (total - steps_done) * step_seconds + evaluations * eval_seconds <= left

        # The time needed grows with the total, so the largest total that fits is found by
        # bisection between "nothing more" and "every second on steps, no evaluations".
        low, high = steps_done, steps_done + max(0, math.floor(left / step_seconds))
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        total = low
        if total <= steps_done:
            raise UsageError(f"{flag}: an optimizer step takes {step_seconds:.2f}s here, and the "
                             f"budget leaves no time for more than the {steps_done} measured; "
                             f"give more time")
        return total
