"""--time-budget in the loop: after each optimizer step the budget's reading of a completed
window of steps (budget.py) becomes the schedule's length, agreed by every rank, recorded and
said.  A run without a budget, or a resumed one whose schedule a budget already fitted (it keeps
the latest fit: the time the stopped run spent is not known to this one), gets `NoBudget`, which
does nothing: the loop never asks which one it has.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Protocol

from accel_train.config import parse_duration
from accel_train.train.budget import SAY_REFIT_FRACTION, TimeBudget, evaluation_passes
from accel_train.train.idle_options import ema_outlasts_the_run
from accel_train.train.optim import warmup_outlasts_words


class RankAgreement(Protocol):
    def max(self, value: float) -> float: ...         # the slowest rank's reading

    def from_main(self, value: int) -> int: ...       # rank 0's count on every rank


class NoBudget:
    def start(self, step: int) -> None:
        pass

    def known_total(self, total_steps: int) -> Optional[int]:
        """The run's length as known before training: the schedule's."""
        return total_steps

    def after_step(self, step: int) -> None:
        pass

    def finish(self, step: int) -> None:
        pass

    def paused(self, evaluates: bool = True):
        return contextlib.nullcontext()


class BudgetPacer:
    """Each time a window of steps is timed (the slowest rank's reading), the schedule's length
    is fitted to the time left; said when it changes much, and recorded in metrics.jsonl,
    config.yaml (`write_resolved`) and the checkpoints (the schedule)."""

    def __init__(self, budget: TimeBudget, config, schedule, loaders, held_out_images: int,
                 probe: Callable[[], tuple[float, int]], ranks: RankAgreement, report, metrics,
                 progress, write_resolved: Callable[[dict], None]):
        """`probe()`: this rank's seconds for one held-out batch through the evaluation, and
        the image passes it made on all ranks together (HeldOutEvaluator.time_one_batch)."""
        self.budget, self.config, self.schedule, self.loaders = budget, config, schedule, loaders
        # forward passes over the held-out images at each evaluating epoch end
        self.eval_images = evaluation_passes(config.model_ema, config.tta) * held_out_images
        self.probe, self.ranks, self.report = probe, ranks, report
        self.metrics, self.progress, self.write_resolved = metrics, progress, write_resolved
        self.flag = f"--time-budget {config.time_budget}"

    def start(self, step: int) -> None:
        self.budget.start(step)

    def known_total(self, total_steps: int) -> Optional[int]:
        """None: the budget fits the length after a few steps."""
        return None

    def paused(self, evaluates: bool = True):
        return self.budget.paused(evaluates)

    def after_step(self, step: int) -> None:
        step_seconds = self.budget.measure(step)
        if step_seconds is None:
            return
        # The slowest rank's step time; rank 0's clock (the ranks' clocks started apart).
        step_seconds = self.ranks.max(step_seconds)
        if self.budget.eval_probe_seconds is None:
            self._probe_evaluation()
        reading = (step_seconds, step, self.loaders.steps_per_epoch, self.eval_images,
                   self.loaders.global_batch)
        eval_every = self.config.eval_every
        if not self.budget.settle(step_seconds):
            # An estimate (the pilot's first step, or the pilot itself when the ranks now time
            # a longer window): it paces the warmup meanwhile.
            estimate = self._agreed(self.budget.steps_that_fit(*reading, eval_every))
            self.schedule.fit_total(estimate, None, step)
            self.report.log(f"time budget {self.config.time_budget}: warmup paced by an "
                            f"estimate at step {step}, {estimate:,} steps")
            return
        first, before = not self.schedule.fixed_by_budget, self.schedule.total_steps
        total = self._agreed(self.budget.total_steps(*reading, eval_every))
        if not first and total == before:
            return
        self.schedule.fit_total(total, step_seconds, step)
        self.write_resolved({"total_steps": total, "budget_step_seconds": step_seconds})
        self.progress.set_total(total)
        self._record(step, total, step_seconds)
        self._say(first, before, total, step_seconds, step)

    def finish(self, step: int) -> None:
        """The steps are trained: a run that ended before the budget fixed its length (on
        --max-steps, say) records the length it had."""
        if not self.schedule.fixed_by_budget:
            self.write_resolved({"total_steps": step})

    def _agreed(self, count: int) -> int:
        # within --max-steps, and rank 0's on every rank: each rank's clock started at its own
        # moment, so the time left differs, and so would the learning rates
        if self.config.max_steps is not None:
            count = min(count, self.config.max_steps)
        return self.ranks.from_main(count)

    def _probe_evaluation(self) -> None:
        """Time one held-out batch through the evaluation, once, for the budget's estimate of
        the evaluations still to come (the slowest rank's): an evaluation costs a share of a
        training step that differs from machine to machine, and a run that only evaluates at
        its end has no epoch end to measure before it must stop."""
        with self.budget.aside():
            seconds, image_passes = self.probe()
        self.budget.eval_probe(self.ranks.max(seconds), image_passes)

    def _record(self, step: int, total: int, step_seconds: float) -> None:
        budget, epoch_end = self.budget, self.budget.epoch_end_seconds
        self.metrics.write({
            "type": "budget", "step": step, "total_steps": total,
            "step_seconds": round(step_seconds, 5),
            "pilot_step_seconds": round(budget.pilot_seconds, 5),
            "epoch_end_seconds": None if epoch_end is None else round(epoch_end, 3),
            "epoch_end_budgeted": round(budget.evaluation_seconds(
                self.eval_images, step_seconds, self.loaders.global_batch), 3),
            "eval_probe_seconds": budget.eval_probe_seconds, "fit": budget.fits,
            "lr_factor": round(self.schedule.decay_from_factor, 6),
            "warmup_steps": self.schedule.warmup_steps})

    def _say(self, first: bool, before: int, total: int, step_seconds: float,
             step: int) -> None:
        budget, config, planned = f"time budget {self.config.time_budget}", self.config, \
            self.schedule.warmup_planned
        if first and total <= step:
            self.report.warn(f"{self.flag}: an optimizer step takes {step_seconds:.2f}s here, "
                             f"and the budget leaves no time for more than the {total:,} "
                             f"steps measured: the run ends there, its schedule cut short "
                             f"(give more time for a whole schedule)")
        elif first:
            self.report.say(f"{budget}: {total:,} steps, "
                            f"{total / self.loaders.steps_per_epoch:.1f} epochs at "
                            f"{1000 * step_seconds:.0f} ms/step (every evaluation included; "
                            f"fitted again as the run goes)")
            if config.warmup_fraction is None and planned >= total:
                self.report.warn(warmup_outlasts_words(
                    config.warmup_epochs, planned, f"the {total:,} that fit the budget here"))
            short_ema = ema_outlasts_the_run(config, total, "the budget fits")
            if short_ema:
                self.report.warn(short_ema)
        elif abs(total - before) >= SAY_REFIT_FRACTION * before:
            self.progress.write(f"{budget}: {before:,} -> {total:,} steps at "
                                f"{1000 * step_seconds:.0f} ms/step lately")


def maybe_pacer(config, schedule, loaders, held_out_images: int,
                probe: Callable[[], tuple[float, int]], ranks: RankAgreement, report, metrics,
                progress, write_resolved: Callable[[dict], None]):
    """The run's pacer: a BudgetPacer with --time-budget, unless the schedule was already fitted
    by one (a resumed run), else NoBudget."""
    if config.time_budget is None or schedule.fixed_by_budget:
        return NoBudget()
    return BudgetPacer(TimeBudget(parse_duration(config.time_budget)), config, schedule,
                       loaders, held_out_images, probe, ranks, report, metrics, progress,
                       write_resolved)
