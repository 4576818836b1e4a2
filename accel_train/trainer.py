"""The training loop on Accelerate: prepare, accumulate, autocast, evaluate with
gather_for_metrics, checkpoint.

What a start continues from is decided before (resume.py); what goes into the model, the loaders
and the schedule is built in model.py, loading.py and optim.py; what a checkpoint holds is the
list of checkpointed parts handed to the Checkpointer once (checkpoint.py), restored in one call;
what the run says is report.py's.  Every random draw is seeded by its place in the run
(randomness.py).  Every rank-sensitive act goes through the Accelerator or distributed.py's rank
helpers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,
                               ProjectConfiguration)

from accel_train.run import distributed
from accel_train.train.autotune import SpeedChoice, choose_on_this_machine, step_timer
from accel_train.data.badimages import BadImageLog
from accel_train.train.budget import SAY_REFIT_FRACTION, TTA_PASSES, TimeBudget, evaluation_passes
from accel_train.config import parse_duration
from accel_train.run.checkpoint import AccelerateState, Checkpointer, TrainerState
from accel_train.run.collectives import EXIT_STALLED, CollectiveTimeouts, dump_stacks, is_timeout
from accel_train.config import TrainConfig
from accel_train.train.datawait import data_wait_clock
from accel_train.train.divergence import stop_if_diverged
from accel_train.model.ema import ModelEma
from accel_train.train.lookahead import LookaheadAverage
from accel_train.base.errors import first_line
from accel_train.train.evaluate import batch_seconds, evaluate_classifier
from accel_train.data.loading import build_loaders, stop_when_stuck
from accel_train.data.mixing import maybe_mixup
from accel_train.train.network import build_network
from accel_train.model.build import create_model, set_train_mode
from accel_train.train.network_choice import NetworkChoice, choose_for_run
from accel_train.train.optim import (base_learning_rates, build_optimizer, plan_schedule,
                                     scheduled_learning_rate, scheduler_for, take_new_learning_rate)
from accel_train.run.plots import write_plots
from accel_train.train.precision import (accelerate_fp16_note, precision_name, resolve_precision,
                                         use_fast_cuda_math)
from accel_train.base.randomness import MICRO_BATCH_SALT, seed_globals
from accel_train.run.report import Reporter, records_text, summary
from accel_train.run.resume import StartPlan, plan_start, record_elastic_job, set_aside_newer
from accel_train.run.rundir import run_paths, update_resolved, write_run_config
from accel_train.data.sources import ArraySource, load_data
from accel_train.data.streaming import load_streaming, streaming_wanted
from accel_train.model.saved import write_model_folder
from accel_train.run.track import LogWindow, MetricsLog, Progress, check_trackers, tracker_scalars


@dataclass
class Callbacks:
    """Seams for programs that drive the trainer (the fault-injection tests, auditing tools).
    Each is optional and called on the ranks and at the moments its comment says."""

    # Main process, inside every checkpoint save: all files written, the manifest not yet.
    before_manifest: Optional[Callable[[int, Path], None]] = None
    # Every rank, every micro-batch: (the optimizer step it belongs to, its sampler keys).
    on_micro_batch: Optional[Callable[[int, torch.Tensor], None]] = None
    # Every rank, once at a resumed start, before any rank trains: steps after this one are
    # about to be redone, so whatever was recorded of them is void.
    on_resume: Optional[Callable[[int], None]] = None


def build_accelerator(config: TrainConfig, precision: str, trackers_dir: Path) -> Accelerator:
    ddp_kwargs = DistributedDataParallelKwargs(
        find_unused_parameters=False, bucket_cap_mb=config.ddp_bucket_mb,
        gradient_as_bucket_view=config.ddp_grad_as_bucket_view,
        static_graph=config.ddp_static_graph)
    return Accelerator(
        cpu=not torch.cuda.is_available(), mixed_precision=precision,
        gradient_accumulation_steps=config.accumulation_steps,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step (optim.py)
        log_with=config.report_to or None, kwargs_handlers=[ddp_kwargs],
        # Batches wait in pinned memory on a GPU (loading.py): their copy can overlap the step.
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),
        # compiled after DDP wrapping, inside prepare (what DDP's optimizer for dynamo expects)
        dynamo_backend="inductor" if config.compile else None,
        project_config=ProjectConfiguration(logging_dir=str(trackers_dir)))


class Trainer:
    def __init__(self, plan: StartPlan, callbacks: Optional[Callbacks] = None):
        self.config = config = plan.config
        self.plan, self.callbacks = plan, callbacks or Callbacks()
        self.paths = run_paths(plan.output_dir)
        self.report = Reporter(plan.messages)
        cuda = torch.cuda.is_available()
        self.streaming = streaming_wanted(config)  # shards read per epoch: streaming/
        self.data = distributed.main_first(
            lambda: load_streaming(config) if self.streaming else load_data(config))
        # Before anything else reads the images (the normalization statistics do): it names each
        # broken one once for all processes, instead of the sources warning on their own.
        self.bad_images = BadImageLog(self.paths.bad_images, self.report, self.data,
                                      distributed.is_global_main())
        self.network_choice = self._choose_network(cuda)
        if self.network_choice is not None:
            self.config = config = dataclasses.replace(
                config, model=self.network_choice.model, smaller_models=[])
        self.net = build_network(config, self.data, plan.env.world_size, cuda, self.report.warn)
        self.speed = self._choose_speed(cuda)
        self.cuda_math = use_fast_cuda_math(cuda)
        self.precision, precision_warning = resolve_precision(self.speed.precision, cuda)
        self.accelerator = acc = build_accelerator(config, self.precision, self.paths.trackers)
        if acc.num_processes != plan.env.world_size:
            raise RuntimeError(f"Accelerate sees {acc.num_processes} processes but the launcher "
                               f"started {plan.env.world_size}: the process group was not shared")
        if self.speed.channels_last:
            self.net.model = self.net.model.to(memory_format=torch.channels_last)
        self.loaders = build_loaders(config, self.data, self.net.spec, acc.num_processes,
                                     acc.process_index, plan.env.local_world_size, cuda)
        self.schedule = plan_schedule(config, self.loaders.steps_per_epoch)
        optimizer = build_optimizer(self.net.model, config)
        self.model, self.optimizer, self.held_out_loader, self.scheduler = \
            acc.prepare(self.net.model, optimizer, self.loaders.held_out,
                        scheduler_for(optimizer, self.schedule))
        self.train_loader = self.loaders.train
        self.train_loader.prepare(acc)
        self.train_loader.warn = self.report.warn  # a loader worker restarted, for one
        self.wait_clock = data_wait_clock(acc.device.type)
        self.mixup = maybe_mixup(config, self.net.spec.num_classes)
        self.loss_fn = self.mixup.loss_fn if self.mixup is not None else \
            torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
        self.state = TrainerState(world_size=acc.num_processes, batch_size=config.batch_size,
                                  accumulation_steps=config.accumulation_steps, seed=config.seed,
                                  train_samples=len(self.data.train), precision=self.precision,
                                  channels_last=self.speed.channels_last,
                                  optimizer=config.optimizer)
        self.ema = ModelEma(self._bare_model(), config.model_ema_decay, config.seed,
                            self.report.warn) if config.model_ema else None
        self.lookahead = LookaheadAverage(self._bare_model(), config.lookahead_every,
                                          self.report.warn) if config.lookahead_every else None
        # What every checkpoint holds and a resume restores, in this order: the checks that
        # refuse a checkpoint (another model, other data) come before anything is loaded.
        self.checkpointer = Checkpointer(
            plan.checkpoint_dir, config.keep_checkpoints, self.report.warn,
            parts=[self.net.spec, self.state, self.train_loader, AccelerateState(acc,
                   self.report.warn), self.schedule, *([self.ema] if self.ema else []),
                   *([self.lookahead] if self.lookahead else []), self.bad_images],
            is_main=acc.is_main_process, barrier=acc.wait_for_everyone,
            before_manifest=self.callbacks.before_manifest, keep_best=config.keep_best)
        self.learning_rate_change = None
        if plan.resume_from is not None:
            wanted = base_learning_rates(self.optimizer)  # what this start's flags built
            self.checkpointer.restore(plan.resume_from)
            self.learning_rate_change = take_new_learning_rate(self.optimizer, self.scheduler,
                                                               wanted)
        self.control_group = distributed.cpu_control_group(acc.num_processes)
        self.stop = distributed.StopSignals(self.control_group)
        self.timeouts = CollectiveTimeouts(
            [None, *([self.control_group] if self.control_group is not None else [])],
            distributed.group_store(), acc.process_index, acc.num_processes,
            config.collective_timeout)
        self.budget = self._maybe_budget()
        self.metrics = MetricsLog(self.paths.metrics, acc.is_main_process)
        self.progress = Progress(acc.is_main_process, config.progress)
        self._open_records([precision_warning, distributed.unusable_gpu_warning(),
                            distributed.ignored_dist_url_warning(config, plan.env),
                            accelerate_fp16_note(config.mixed_precision, self.precision,
                                                 os.environ)])

    @classmethod
    def from_config(cls, config: TrainConfig, callbacks: Optional[Callbacks] = None) -> "Trainer":
        """The launcher's environment and process group, the start plan, then the trainer."""
        plan = plan_start(config, distributed.setup(config))
        try:
            return cls(plan, callbacks)
        except BaseException:
            plan.release()
            raise

    # -- start --------------------------------------------------------------------------------
    def _choose_network(self, cuda: bool) -> Optional[NetworkChoice]:
        """--smaller-models with --time-budget: the network this machine can train for
        --min-budget-epochs within the budget (network_choice.py), timed by rank 0 for all.
        A resumed run's plan already names the checkpoint's network (resume.keep_choices)."""
        config = self.config
        if not config.smaller_models:
            return None
        if config.time_budget is None:
            self.report.warn(f"--smaller-models chooses by --time-budget, which this run does "
                             f"not have: training --model {config.model}")
            return None
        decided = distributed.decide_on_main(lambda: choose_for_run(
            config, config.image_size or self.data.train.native_size,
            len(self.data.class_names), len(self.data.train), self.plan.env.world_size,
            cuda).to_dict())
        return NetworkChoice.from_dict(decided)

    def _network_choice_text(self) -> Optional[str]:
        if self.network_choice is not None:
            return self.network_choice.how
        if "network" in self.plan.kept_choices:
            return "kept from the checkpoint (--smaller-models)"
        return None

    def _choose_speed(self, cuda: bool) -> SpeedChoice:
        """--mixed-precision and --channels-last: as asked; "auto" on a CPU, measured on this
        model (autotune.py), by rank 0 for all.  A resumed run's plan already holds what the
        checkpoint ran with (resume.keep_choices)."""
        config = self.config
        kept = [choice for choice in self.plan.kept_choices if choice != "network"]
        precision, channels_last = config.mixed_precision, config.channels_last
        spec = self.net.spec

        if self.network_choice is not None:  # already timed while choosing the network
            return self.network_choice.speed

        def measure() -> dict:
            time_step = step_timer(
                lambda: create_model(config.model, spec.num_classes, config.drop_rate, None,
                                     config.drop_path),
                config.batch_size, spec.image_size, spec.num_classes)
            return choose_on_this_machine(precision, channels_last, cuda, time_step).__dict__

        choice = SpeedChoice(**distributed.decide_on_main(measure))
        if kept:
            choice = dataclasses.replace(choice, how=f"{' and '.join(kept)} kept from the "
                                                     f"checkpoint")
        return choice

    def _bare_model(self) -> torch.nn.Module:
        """The model without DDP's and torch.compile's wrappers: the parameter names of the
        model itself (a compiled model's state dict would prefix each with `_orig_mod.`)."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps

    def _maybe_budget(self) -> Optional[TimeBudget]:
        """--time-budget, unless a resumed run already fitted its schedule: it keeps the latest
        fit (the time the stopped run spent is not known to this one)."""
        if self.config.time_budget is None or self.schedule.fixed_by_budget:
            return None
        return TimeBudget(parse_duration(self.config.time_budget))

    def _maybe_fit_schedule(self):
        """--time-budget: each time a window of steps is timed (the slowest rank's reading),
        the schedule's length is fitted to the time left; said when it changes much, and
        recorded (a resumed run keeps the latest fit)."""
        step_seconds = self.budget.measure(self.state.step)
        if step_seconds is None:
            return
        # The slowest rank's step time; rank 0's clock (the ranks' clocks started apart).
        step_seconds = distributed.max_over_ranks(step_seconds, self.control_group)
        if self.budget.eval_probe_seconds is None:
            self._probe_evaluation()
        loaders, state, before = self.loaders, self.state, self.schedule.total_steps
        passes = evaluation_passes(self.ema is not None, self.config.tta)
        reading = (step_seconds, state.step, loaders.steps_per_epoch,
                   passes * len(self.data.held_out), loaders.global_batch)

        def agreed(count: int) -> int:
            # within --max-steps, and rank 0's on every rank: each rank's clock started at its
            # own moment, so the time left differs, and so would the learning rates
            if self.config.max_steps is not None:
                count = min(count, self.config.max_steps)
            return distributed.from_main(count, self.control_group)

        if not self.budget.settle(step_seconds):
            # An estimate (the pilot's first step, or the pilot itself when the ranks now time
            # a longer window): it paces the warmup meanwhile.
            estimate = agreed(self.budget.steps_that_fit(*reading, self.config.eval_every))
            self.schedule.fit_total(estimate, None, state.step)
            self.report.log(f"time budget {self.config.time_budget}: warmup paced by an "
                            f"estimate at step {state.step}, {estimate:,} steps")
            return
        first = not self.schedule.fixed_by_budget
        total = agreed(self.budget.total_steps(*reading, f"--time-budget "
                                               f"{self.config.time_budget}",
                                               self.config.eval_every))
        if not first and total == before:
            return
        self.schedule.fit_total(total, step_seconds, state.step)
        if self.accelerator.is_main_process:
            update_resolved(self.plan.output_dir, {"total_steps": total,
                                                   "budget_step_seconds": step_seconds})
        self.progress.set_total(total)
        epoch_end = self.budget.epoch_end_seconds
        self.metrics.write({"type": "budget", "step": state.step, "total_steps": total,
                            "step_seconds": round(step_seconds, 5),
                            "pilot_step_seconds": round(self.budget.pilot_seconds, 5),
                            "epoch_end_seconds": None if epoch_end is None else
                            round(epoch_end, 3),
                            "epoch_end_budgeted": round(self.budget.evaluation_seconds(
                                passes * len(self.data.held_out), step_seconds,
                                loaders.global_batch), 3),
                            "eval_probe_seconds": self.budget.eval_probe_seconds,
                            "fit": self.budget.fits,
                            "lr_factor": round(self.schedule.decay_from_factor, 6),
                            "warmup_steps": self.schedule.warmup_steps})
        budget = f"time budget {self.config.time_budget}"
        if first:
            self.report.say(f"{budget}: {total:,} steps, {total / loaders.steps_per_epoch:.1f} "
                            f"epochs at {1000 * step_seconds:.0f} ms/step (every evaluation "
                            f"included; fitted again as the run goes)")
            if self.config.warmup_fraction is None and self.schedule.warmup_planned >= total:
                self.report.warn(f"--warmup-epochs {self.config.warmup_epochs:g} is "
                                 f"{self.schedule.warmup_planned:,} steps, as many as or more "
                                 f"than the {total:,} that fit the budget here: the learning "
                                 f"rate will not come down from its peak (--warmup-fraction F "
                                 f"makes the warmup a share of the run, the decay the rest)")
        elif abs(total - before) >= SAY_REFIT_FRACTION * before:
            self.progress.write(f"{budget}: {before:,} -> {total:,} steps at "
                                f"{1000 * step_seconds:.0f} ms/step lately")

    def _probe_evaluation(self):
        """Time one held-out batch through the evaluation, once, for the budget's estimate of
        the evaluations still to come (the slowest rank's): an evaluation costs a share of a
        training step that differs from machine to machine, and a run that only evaluates at
        its end has no epoch end to measure before it must stop."""
        with self.budget.aside():
            seconds, images = batch_seconds(self.accelerator, self._bare_model(),
                                            self.held_out_loader.dataset, self.config.batch_size,
                                            self.speed.channels_last, self.config.tta)
        seconds = distributed.max_over_ranks(seconds, self.control_group)
        # per image and view, all ranks evaluating their shares at once
        self.budget.eval_probe(seconds, images * TTA_PASSES[self.config.tta]
                               * self.accelerator.num_processes)

    def _open_records(self, warnings: list[Optional[str]]):
        """The start is good: open the logs, record the run, say what will run."""
        acc, plan = self.accelerator, self.plan
        if plan.resume is not None:  # reads metrics.jsonl: a damaged one stops before any write
            self._forget_steps_after(self.state.step)
        if plan.resume_from is not None and acc.is_main_process:
            # Only now that every part has loaded: that future is about to be redone (resume.py).
            set_aside_newer(plan.checkpoint_dir, self.state.step, self.report.warn)
        self.report.open_log(self.paths.logs, acc.process_index, distributed.describe_process())
        if plan.resume_from is None and plan.resume is not None:
            self.report.say("no valid checkpoint found: starting from scratch")
        elif plan.resume_from is not None:
            self.metrics.write({"type": "resume", "step": self.state.step,
                                "from": str(plan.resume_from), "world_size": acc.num_processes,
                                "previous_world_size": plan.previous.world_size,
                                "accumulation_steps": self.config.accumulation_steps})
            self.report.say(f"resumed from {plan.resume_from} at step {self.state.step} (epoch "
                            f"{self.state.epoch + 1}, {self.state.samples_in_epoch} samples "
                            f"into it)")
            if self.learning_rate_change is not None:
                before, now = self.learning_rate_change
                self.report.say(f"--learning-rate {now:g} (the checkpoint's run had {before:g}): "
                                f"the schedule goes on from step {self.state.step}, scaled")
        facts = self._resolved_facts()
        if acc.is_main_process:
            # What auto chose is recorded as the option: `--config config.yaml` repeats the run
            # exactly instead of timing the machine again (speed_choice says it was auto's).
            chosen = dataclasses.replace(self.config, mixed_precision=self.speed.precision,
                                         channels_last=self.speed.channels_last)
            write_run_config(plan.output_dir, chosen, facts)
            record_elastic_job(plan.output_dir, plan.env.run_id)
        if self.config.report_to:
            acc.init_trackers("accel_train", config={
                k: v for k, v in self.config.to_dict().items()
                if isinstance(v, (int, float, str, bool))})
        for text in filter(None, warnings):
            self.report.warn(text)
        backend = dist.get_backend() if acc.num_processes > 1 else None
        self.report.say(summary(facts, self.data.description, self.config.accumulation_steps,
                                backend, records_text(self.paths, self.config.report_to,
                                                      self.config.plots)))
        self.bad_images.collect()  # those met while decoding into memory

    def _forget_steps_after(self, step: int):
        """Logs read as if the run had never stopped: what came after `step` is redone."""
        self.metrics.truncate_after(step)
        if self.callbacks.on_resume is not None:
            self.callbacks.on_resume(step)
        self.accelerator.wait_for_everyone()  # before any rank appends again

    def _resolved_facts(self) -> dict:
        acc, loaders = self.accelerator, self.loaders
        return {"precision_used": precision_name(self.precision),
                "precision_requested": self.config.mixed_precision,
                "channels_last": self.speed.channels_last, "speed_choice": self.speed.how,
                "speed_timings": self.speed.timings,
                "device": str(acc.device), "distributed_type": str(acc.distributed_type),
                "cuda_math": self.cuda_math,
                "world_size": acc.num_processes, "global_batch": loaders.global_batch,
                "steps_per_epoch": loaders.steps_per_epoch,
                # a --time-budget run fixes it after measuring (then recorded here too)
                "total_steps": None if self.budget is not None else self.total_steps,
                "train_samples": len(self.data.train), "eval_samples": len(self.data.held_out),
                "num_workers": loaders.num_workers,
                "data_in_memory": isinstance(self.data.train, ArraySource),
                # resized, cropped and flipped on the device rather than in the loader
                "placed_on_device": loaders.train.finish.places,
                "sync_bn": self.net.sync_bn, "model": self.net.spec.__dict__,
                "whitened_stem": self.net.whitened,
                "network_choice": self._network_choice_text(),
                "trainable_parameters": self.net.num_trainable,
                "launcher": distributed.launcher_facts(),
                "output_dir": str(self.plan.output_dir),
                "checkpoint_dir": str(self.plan.checkpoint_dir)}

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> int:
        """Train to the end (or to a stop signal); returns the process exit code."""
        state = self.state
        self.progress.start(None if self.budget is not None else self.total_steps, state.step)
        started = time.perf_counter()
        if self.budget is not None:
            self.budget.start(state.step)
        with self.stop.handlers_installed():
            try:
                while state.step < self.total_steps:
                    epoch_started = time.perf_counter()
                    if self.train_epoch():
                        return self._stop_for_signal()
                    self.timeouts.relax()  # evaluation and checkpoint: healthy long waits
                    evaluates = self._evaluates_at_epoch_end()
                    with self.budget.paused(evaluates) if self.budget else \
                            contextlib.nullcontext():
                        self._end_epoch(time.perf_counter() - epoch_started, evaluates)
                if state.samples_in_epoch:  # --max-steps ended mid-epoch
                    self._end_epoch(None, evaluates=True)
            except RuntimeError as err:
                if not (self.timeouts.active and is_timeout(err)):
                    raise
                return self._stalled(err)
            finally:
                self.progress.close()
        self.timeouts.relax()
        self.report.say(f"Training took {time.perf_counter() - started:.1f}s")
        if self.bad_images.summary():
            self.report.say(self.bad_images.summary())
        self.save_model()
        self._maybe_plot()
        out = self.plan.output_dir
        self.report.say(f"best held-out top-1 {state.best_top1 or 0:.2%}; next: accel-train eval "
                        f"{out}  |  accel-train predict {out} IMAGES...  |  accel-train plot {out}")
        return 0

    def train_epoch(self) -> bool:
        """Run (the rest of) the current epoch; True if a stop signal ended it early."""
        acc, config, state = self.accelerator, self.config, self.state
        set_train_mode(self.model, config.freeze_backbone)
        per_micro_step = config.batch_size * acc.num_processes
        window = LogWindow()
        self.wait_clock.take()  # the last epoch's steps after its last logged one
        # The epoch's first step waits for every rank's loader to start: the long timeout.
        self.timeouts.relax()
        first_step, step_started = state.step + 1, time.perf_counter()
        batches = iter(self.train_loader)  # from where the loader stands in its epoch
        while state.step < self.total_steps:
            self.wait_clock.before_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                break
            self.wait_clock.after_fetch()
            self.bad_images.note("train", batch.replaced)
            if self.callbacks.on_micro_batch is not None:
                self.callbacks.on_micro_batch(state.step + 1, batch.keys)
            with acc.accumulate(self.model):
                loss, num_correct = self.train_step(batch.images, batch.labels)
            window.add(loss, num_correct, per_micro_step)
            state.samples_in_epoch = self.train_loader.samples_in_epoch
            state.samples_seen += per_micro_step
            if not acc.sync_gradients:
                continue
            if not self.optimizer.step_was_skipped:  # fp16 overflow: the lr waits too
                self.scheduler.step()
            state.step += 1
            self.timeouts.beat(state.step)
            if state.step > first_step:
                self.timeouts.observe(time.perf_counter() - step_started)
            step_started = time.perf_counter()
            if state.step == first_step:
                self._agree_on_tight_timeout()
            if self.budget is not None:
                self._maybe_fit_schedule()
            if self.lookahead is not None:
                self.lookahead.after_step(state.step, self.total_steps)
            if self.ema is not None:
                self.ema.update(self._bare_model(), state.step)
            if state.step % config.log_every == 0:
                self._log_window(window)
                window = LogWindow()
                self._agree_on_tight_timeout()  # 20x the slowest step seen so far
            if self.stop.agreed():
                return True
            self._maybe_checkpoint("step")
        return False

    def train_step(self, images: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward, backward, and (on the last micro-step) the update.
        Returns the loss and how many of the images the model got right (the running train
        accuracy costs one argmax; it is measured on augmented images, in train mode)."""
        # The micro-batch's place in the run: every draw from here to the update (Mixup/CutMix,
        # dropout and drop-path inside the model) is a function of it, not of what drew before.
        position = (self.state.epoch, self.state.samples_in_epoch, self.accelerator.process_index)
        seed_globals(self.config.seed, *position, MICRO_BATCH_SALT)
        targets = labels
        if self.mixup is not None:
            images, targets = self.mixup(images, labels, position)
        if self.speed.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with self.accelerator.autocast():
            logits = self.model(images)
            loss = self.loss_fn(logits, targets)
        self.accelerator.backward(loss)
        if self.config.grad_clip and self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()  # Accelerate makes these no-ops until the accumulation completes
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), (logits.detach().argmax(dim=1) == labels).sum()

    def _evaluates_at_epoch_end(self) -> bool:
        """--eval-every N: the Nth epoch ends evaluate, and the last always does (the run's
        final numbers; a time budget's latest fit decides which epoch is the last)."""
        every, state = self.config.eval_every, self.state
        return state.step >= self.total_steps or bool(every and (state.epoch + 1) % every == 0)

    def _end_epoch(self, epoch_seconds: Optional[float], evaluates: bool):
        state = self.state
        if self.lookahead is not None:
            self.lookahead.at_epoch_end()   # what is evaluated and saved is the average
        record = {"type": "epoch", "epoch": state.epoch + 1, "step": state.step}
        began = time.perf_counter()
        summary = (self._evaluate_into(record) if evaluates else
                   f"not evaluated (--eval-every {self.config.eval_every})")
        if evaluates:  # what --time-budget's estimate of it is read against
            record["eval_time"] = round(time.perf_counter() - began, 3)
        if epoch_seconds is not None:
            record["epoch_time"] = round(epoch_seconds, 3)
        record["bad_images"] = self.bad_images.collect()
        self.metrics.write(record)
        self.accelerator.log(tracker_scalars(record), step=state.step)
        timing = f" Time {epoch_seconds:.1f}s" if epoch_seconds is not None else ""
        self.progress.write(f"Epoch {state.epoch + 1}{timing}: {summary}")
        self.next_epoch()
        self._maybe_checkpoint("epoch end")

    def _evaluate_into(self, record: dict) -> str:
        """The epoch end's evaluation (and the EMA's): into the state and `record`; returns
        the console's words for it."""
        state = self.state
        results = self.evaluate()
        state.best_top1 = max(results["top1"], state.best_top1 or 0.0)
        state.eval_top1, state.eval_step = results["top1"], state.step
        record.update({f"eval_{k}": v for k, v in results.items() if k != "per_class"})
        ema_text = ""
        if self.ema is not None:
            ema_results = self.evaluate(self.ema.module)
            state.ema_top1 = ema_results["top1"]
            record.update({f"eval_ema_{k}": ema_results[k] for k in ("loss", "top1", "top5")})
            ema_text = f", EMA top1 {state.ema_top1:.2%}"
        return (f"eval loss {results['loss']:.4f} top1 {results['top1']:.2%} top5 "
                f"{results['top5']:.2%}{ema_text} ({results['count']} images)")

    def next_epoch(self):
        """The epoch is over: the state and the train loader both stand at the next one."""
        self.state.epoch += 1
        self.state.samples_in_epoch = 0
        self.train_loader.set_epoch(self.state.epoch)

    def evaluate(self, model=None) -> dict:
        """Loss, top-1, top-5 and per-class accuracy over the whole held-out split, each sample
        once (see evaluate.py; `accel-train eval` computes the same numbers the same way), of
        the trained model or of `model` (the EMA weights)."""
        # The bare module: no DDP buffer broadcast, so no collective inside forward.  Not
        # unwrap_model's default (keep_torch_compile=True): for a compiled DDP model that
        # re-points the compiled wrapper at the bare model, and training after the first
        # evaluation would bypass DDP (no_sync lost under accumulation).
        model = self._bare_model() if model is None else model
        if self.accelerator.num_processes > 1:
            # DDP hands rank 0's buffers (BatchNorm running statistics) to the other ranks only
            # at the next training forward; until then each rank holds the statistics of its
            # own last batch.  Every shard is evaluated with rank 0's, the ones the checkpoint
            # and model.safetensors keep (and the ones training continues with anyway).
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        batches = stop_when_stuck(self.held_out_loader, self.config.loader_timeout,
                                  f"evaluating after step {self.state.step}")
        return evaluate_classifier(self.accelerator, model, self.bad_images.strip(batches),
                                   self.net.spec.num_classes, self.speed.channels_last,
                                   self.config.tta)

    # -- records, checkpoints, the end --------------------------------------------------------
    def _log_window(self, window: "LogWindow"):
        acc, state = self.accelerator, self.state
        loss = acc.reduce(torch.stack(window.losses).mean().to(acc.device), "mean").item()
        if not math.isfinite(loss):  # (the reduced loss: every rank takes this branch)
            stop_if_diverged(self._bare_model(), state.step)
        correct = acc.reduce(torch.stack(window.correct).sum().to(acc.device), "sum").item()
        elapsed = time.perf_counter() - window.started
        window.data_wait = self.wait_clock.take()  # after the .item()s: no sync of its own
        record = {"type": "train", "step": state.step, "epoch": state.epoch + 1,
                  "loss": round(loss, 6), "top1": round(correct / window.samples, 4),
                  "lr": scheduled_learning_rate(self.optimizer),
                  "img_per_s": round(window.samples / elapsed, 2),
                  "data_wait": round(window.data_wait / elapsed, 4),
                  "samples_seen": state.samples_seen}
        self.bad_images.collect()
        self.metrics.write(record)
        self.accelerator.log(tracker_scalars(record), step=state.step)
        self.progress.update(state.step, record)

    def _maybe_checkpoint(self, event: str) -> Optional[Path]:
        """The one place that decides when to save: at every epoch end (after evaluating, so
        the checkpoint's best top-1 is current), on an agreed stop signal, and every
        --checkpoint-every optimizer steps in between (not at an epoch's last step or the
        run's last step: the epoch end saves those)."""
        state = self.state
        if event == "step":
            every = self.config.checkpoint_every
            at_epoch_end = state.samples_in_epoch >= self.train_loader.usable
            if not every or state.step % every or at_epoch_end or state.step >= self.total_steps:
                return None
        with self.timeouts.relaxed():  # rank 0 writes; the others wait at its barrier
            return self.save_checkpoint(event)

    def save_checkpoint(self, why: str = "asked") -> Path:
        """Save now (every rank calls it together); `_maybe_checkpoint` decides when."""
        stop_if_diverged(self._bare_model(), self.state.step, f"the checkpoint ({why})")
        path = self.checkpointer.save()
        self.report.log(f"saved checkpoint {path} ({why})")
        return path

    def _agree_on_tight_timeout(self):
        self.timeouts.tighten(lambda seconds: distributed.max_over_ranks(seconds,
                                                                         self.control_group))

    def _stalled(self, err: RuntimeError) -> int:
        """A collective timed out: name who stalled, keep this rank's stacks, and exit so that
        the elastic launcher restarts the group from the newest checkpoint."""
        line = self.timeouts.describe_stall(self.state.step)
        log = self.paths.logs / f"rank{self.accelerator.process_index}.log"
        # Where this rank waited (the error's traceback), then every thread as it is now.
        self.report.log_exception(f"{line} ({first_line(err, 300)})")
        dump_stacks(log)
        if self.timeouts.first_to_report():
            print(f"accel_train: error (rank {self.accelerator.process_index}): {line}; Python "
                  f"stacks in {log}; exit {EXIT_STALLED}: restart the group (the elastic "
                  f"launcher does, --max_restarts) with --resume auto", file=sys.stderr,
                  flush=True)
        return EXIT_STALLED

    def _stop_for_signal(self) -> int:
        self.timeouts.relax()
        self.bad_images.collect()
        path = self._maybe_checkpoint("stop signal")
        self.report.say(f"stopped by a signal at step {self.state.step}: saved {path}; run the "
                        f"same command with --resume auto to continue")
        return 143  # 128 + SIGTERM: schedulers read it as "terminated", not "finished"

    def save_model(self):
        """model.safetensors + config.json in timm's folder format (timm_folder.py): timm,
        transformers and our eval/predict rebuild the model from them.  With --model-ema, the
        better of the raw and the EMA weights on the held-out split."""
        acc, state = self.accelerator, self.state
        acc.wait_for_everyone()
        use_ema = self.ema is not None and (state.ema_top1 or 0) > (state.eval_top1 or 0)
        model = self.ema.module if use_ema else self._bare_model()
        stop_if_diverged(model, state.step, "model.safetensors")
        if acc.is_main_process:
            spec = dataclasses.replace(self.net.spec, weights="ema" if use_ema else "model")
            path = write_model_folder(model, self.plan.output_dir, spec, command=sys.argv)
            self.report.say(f"saved {path}" + (f" (the EMA weights: held-out top-1 "
                                               f"{state.ema_top1:.2%} vs {state.eval_top1:.2%})"
                                               if use_ema else ""))
        acc.wait_for_everyone()

    def _maybe_plot(self):
        """PNG curves in <run>/plots (main process).  Drawing comes after the model is saved and
        a failure only warns: a finished run must not end as failed over a figure."""
        if not (self.config.plots and self.accelerator.is_main_process):
            return
        try:
            written = write_plots(self.plan.output_dir)
        except Exception as err:  # matplotlib/font trouble; the traceback goes to the rank log
            self.report.log_exception("drawing the plots failed")
            self.report.warn(f"could not draw the plots ({type(err).__name__}: {err}); try "
                             f"again with accel-train plot {self.plan.output_dir}")
            return
        if written:
            self.report.say(f"plots: {', '.join(str(path) for path in written)}")

    def close(self):
        try:
            self.accelerator.end_training()
        finally:
            self.plan.release()


def run_training(config: TrainConfig, callbacks: Optional[Callbacks] = None) -> int:
    """Parse-build-train-close: the whole `train` command."""
    check_trackers(config.report_to)  # accelerate would ignore a missing one, or raise later
    trainer = None
    try:
        trainer = Trainer.from_config(config, callbacks)
        return trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        distributed.teardown()
