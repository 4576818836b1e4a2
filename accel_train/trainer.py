"""The training loop on Accelerate, in the tutorial's order: build (`Trainer.from_config`: the
data, the network, how it computes), prepare (`Trainer.__init__`: the Accelerator, the loaders,
`accelerator.prepare`, the checkpointed parts, restored on resume), loop (`train`), accumulate
(`train_epoch`), step (`train_step`), evaluate (`end_epoch`), checkpoint (`maybe_checkpoint`).

What options turn on are parts that decide for themselves when to act, each built once by a
factory that returns the real part or one that does nothing: the time budget's pacer
(train/pacing.py), the EMA and lookahead averages (model/ema.py, train/lookahead.py), Mixup and
CutMix (data/mixing.py).  The loop never asks which are on.  What a checkpoint holds is the list
of parts handed to the Checkpointer once (run/checkpoint.py); what a start records is
run/records.py's, a finished run's end run/finish.py's.  Every random draw is seeded by its
place in the run (base/randomness.py); every rank-sensitive act goes through the Accelerator or
run/distributed.py.  Programs add their own code at fixed points through callbacks.py.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import weakref
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,
                               ProjectConfiguration)

from accel_train.base.errors import UsageError, first_line
from accel_train.base.randomness import MICRO_BATCH_SALT, seed_globals
from accel_train.base.readers import ANOTHER_MODELS_WEIGHTS, BadFile
from accel_train.callbacks import Callback, CallbackList
from accel_train.config import TrainConfig
from accel_train.data.badimages import BadImageLog
from accel_train.data.held_out_kept import pacer_for
from accel_train.data.loaders import end_workers
from accel_train.data.loading import build_loaders, refuse_bad_loader_input
from accel_train.data.class_weights import maybe_class_weights
from accel_train.data.mixing import maybe_mixup
from accel_train.data.sources import LoadedData, load_data
from accel_train.data.streaming import load_streaming, streaming_wanted
from accel_train.model.build import create_model, set_train_mode
from accel_train.model.ema import maybe_ema
from accel_train.model.outputs import LogitsHook, kept_auxiliary_logits, return_logits
from accel_train.model.saved import is_import_path
from accel_train.run import distributed
from accel_train.run.checkpoint import AccelerateState, Checkpointer
from accel_train.run.checkpoint_cadence import CheckpointCadence
from accel_train.run.trainer_state import TrainerState
from accel_train.run.collectives import CollectiveTimeouts, StepWatch, is_timeout, report_stall
from accel_train.run.finish import (already_finished, maybe_plot, save_final_model, say_next,
                                    tested_at, test_record)
from accel_train.run.records import open_records, resolved_facts
from accel_train.run.report import Reporter
from accel_train.run.resume import StartPlan, plan_start
from accel_train.run.rundir import run_paths, update_resolved
from accel_train.run.track import MetricsLog, Progress, TrainLog, check_trackers, tracker_scalars
from accel_train.train.autotune import SpeedChoice, planned_images, speed_for_run, step_timer
from accel_train.train.datawait import data_wait_clock
from accel_train.train.divergence import stop_if_diverged
from accel_train.train.evaluate import (HeldOutEvaluator, epoch_record, epoch_words,
                                        maybe_test_split)
from accel_train.train.host_memory import keep_freed_host_memory
from accel_train.train.lookahead import maybe_lookahead
from accel_train.train.network import Network, build_network
from accel_train.train.network_choice import choice_words, network_for_run
from accel_train.train.optim import (base_learning_rates, build_optimizer, long_warmup_warning,
                                     plan_schedule, scheduler_for, take_new_learning_rate)
from accel_train.train.idle_options import idle_option_warnings
from accel_train.train.pacing import maybe_pacer
from accel_train.train.precision import (accelerate_fp16_note, precision_name,
                                         precision_this_process_holds, resolve_precision,
                                         use_fast_cuda_math)
from accel_train.train.stem_bias import maybe_stem_bias_stop
from accel_train.train.selection import top5_picks_nothing
from accel_train.train.skipped_parameters import naming_skipped_parameters

STOPPED_EXIT = 143  # 128 + SIGTERM: schedulers read it as "terminated", not "finished"


def build_accelerator(config: TrainConfig, precision: str, trackers_dir: Path,
                      find_unused: bool = False, resumed_precision: bool = False) -> Accelerator:
    """`find_unused`: the network has trainable parameters its train-mode forward never uses;
    `resumed_precision`: `precision` is the one the checkpoint this run resumes trained in."""
    held = precision_this_process_holds()
    if held is not None and held != precision:  # Accelerate would raise its ValueError
        refused = (f"this process already trained in {precision_name(held)}, and accelerate "
                   f"keeps one precision a process: ")
        # auto takes the checkpoint's precision on resume: only a new process helps there
        raise UsageError(refused + (
            f"the checkpoint this run resumes trained in {precision_name(precision)}; resume "
            f"it in a new process" if resumed_precision else
            f"this run cannot train in {precision_name(precision)}; pass --mixed-precision "
            f"{held} (or leave it to auto), or train in a new process"))
    ddp_kwargs = DistributedDataParallelKwargs(
        find_unused_parameters=find_unused or config.ddp_find_unused_parameters,
        bucket_cap_mb=config.ddp_bucket_mb,
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
    # -- build ----------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: TrainConfig, callbacks: Iterable[Callback] = (), *,
                    bring_data: Optional[Callable[[TrainConfig], LoadedData]] = None,
                    model: Optional[torch.nn.Module] = None) -> "Trainer":
        """The launcher's environment and process group, the start plan, the data (rank 0
        first), the network (with --smaller-models, the one the budget holds) and how it
        computes; then the trainer, prepared.  `bring_data` and `model` (the Python API's): the data
        and the network a program brings instead of those the options name."""
        callbacks = CallbackList(callbacks)  # a wrong one refused before anything starts
        plan = plan_start(config, distributed.setup(config))
        logits_hook, report = None, Reporter(plan.messages)
        try:
            config, cuda = plan.config, torch.cuda.is_available()
            keep_freed_host_memory(cuda, os.environ)  # before the probes time any step
            read = bring_data or (load_streaming if streaming_wanted(config) else load_data)
            data = distributed.main_first(lambda: read(config))
            # Before anything else reads the images (the normalization statistics do): it names
            # each broken one once for all processes, instead of the sources warning on their own.
            bad_images = BadImageLog(run_paths(plan.output_dir).bad_images, report, data,
                                     distributed.is_global_main())
            config, choice = network_for_run(config, data, plan.env.world_size, cuda, report.warn)
            # its calls return the logits tensor, also where it returns an object holding them
            # (outputs.py); undone at close, for the program to have its module back as it was
            logits_hook = return_logits(model) if model is not None else None
            # the speed probe times fresh copies: of the program's module as it was handed over
            untouched = copy.deepcopy(model) if model is not None else None
            net = build_network(config, data, plan.env.world_size, cuda, report.warn, model)
            refuse_bad_loader_input(config, data, net.spec, plan.env.world_size, cuda)
            fresh_model = (lambda: copy.deepcopy(untouched)) if model is not None else (
                lambda: create_model(config.model, net.spec.num_classes, config.drop_rate, None,
                                     config.drop_path, net.spec.model_args))
            speed = speed_for_run(config, fresh_model, net.spec, plan.kept_choices,
                                  choice.speed if choice else None, cuda,
                                  planned_images(config, len(data.train), plan.env.world_size))
            return cls(dataclasses.replace(plan, config=config), data, net, speed, report=report,
                       bad_images=bad_images, callbacks=callbacks,
                       network_choice=choice_words(choice, plan.kept_choices),
                       logits_hook=logits_hook)
        except BaseException:
            plan.release()
            if logits_hook is not None:
                logits_hook.remove()
            raise

    # -- prepare --------------------------------------------------------------------------------
    def __init__(self, plan: StartPlan, data, net: Network, speed: SpeedChoice, *,
                 report: Optional[Reporter] = None, bad_images: Optional[BadImageLog] = None,
                 network_choice: Optional[str] = None, callbacks: Iterable[Callback] = (),
                 logits_hook: Optional[LogitsHook] = None):
        """A run of `net` on `data` (`from_config` builds both from the options), computing as
        `speed` says: the Accelerator, the model, optimizer, schedule and loaders through
        `accelerator.prepare`, the checkpointed parts (restored on resume), the loop's parts,
        then the run's records.  `report` and `bad_images`: those the build spoke through;
        `network_choice`: how --smaller-models chose the network, for the summary;
        `logits_hook`: what makes a program's module return its logits, removed at close."""
        self.plan, self.config, self.data, self.net, self.speed = \
            plan, plan.config, data, net, speed
        self.paths = run_paths(plan.output_dir)
        self.report = report or Reporter(plan.messages)
        self.bad_images = bad_images or BadImageLog(self.paths.bad_images, self.report, data,
                                                    distributed.is_global_main())
        self.network_choice, self.callbacks = network_choice, CallbackList(callbacks)
        self.logits_hook = logits_hook
        cuda = torch.cuda.is_available()
        self.cuda_math = use_fast_cuda_math(cuda)
        # (from_config made the same two mallopt calls before its probes; made again here, they
        # change nothing and give the summary its words, also for a Trainer built directly)
        self.host_memory = keep_freed_host_memory(cuda, os.environ)
        self.precision, precision_warning = resolve_precision(speed.precision, cuda)
        self.accelerator = build_accelerator(
            self.config, self.precision, self.paths.trackers, find_unused=bool(net.unused),
            resumed_precision="precision" in plan.kept_choices)
        if self.accelerator.num_processes != plan.env.world_size:
            raise RuntimeError(f"Accelerate sees {self.accelerator.num_processes} processes but "
                               f"the launcher started {plan.env.world_size}: the process group "
                               f"was not shared")
        self._prepare(cuda)
        self._prepare_checkpointed_parts()
        self.learning_rate_change = self._maybe_restore()
        self._prepare_step_parts()
        # A finished run started again with the same options: nothing to train, nothing to write.
        self.finished_before = self._evaluated_at_end() and distributed.decide_on_main(
            lambda: already_finished(plan.output_dir, self.state.step,
                                     self.loaders.test is not None))
        if self.finished_before:
            return
        self._open_records([precision_warning, long_warmup_warning(self.config, self.schedule),
                            *idle_option_warnings(self.config,
                                                  self.pacer.known_total(self.total_steps)),
                            *self.data.warnings,
                            top5_picks_nothing(self.config.eval_metric, net.spec.num_classes),
                            distributed.unusable_gpu_warning(),
                            distributed.ignored_dist_url_warning(self.config, plan.env),
                            accelerate_fp16_note(self.config.mixed_precision, self.precision,
                                                 os.environ)])

    def _prepare(self, cuda: bool):
        """The loaders, the schedule and the optimizer; model, optimizer, held-out loader and
        scheduler through `accelerator.prepare` (the train loader prepares itself)."""
        acc, config, net = self.accelerator, self.config, self.net
        if self.speed.channels_last:
            net.model = net.model.to(memory_format=torch.channels_last)
        self.loaders = build_loaders(config, self.data, net.spec, acc.num_processes,
                                     acc.process_index, self.plan.env.local_world_size, cuda,
                                     acc.device, train_rate=self._training_rate)
        self.schedule = plan_schedule(config, self.loaders.steps_per_epoch)
        optimizer = build_optimizer(net.model, config, fused=cuda)
        self.model, self.optimizer, self.held_out_loader, self.scheduler = \
            acc.prepare(net.model, optimizer, self.loaders.held_out,
                        scheduler_for(optimizer, self.schedule))
        self.train_loader = self.loaders.train
        self.train_loader.prepare(acc)
        self.train_loader.warn = self.report.warn  # a loader worker restarted, for one
        self.evaluator = HeldOutEvaluator(acc, self.held_out_loader, self.bad_images,
                                          net.spec.num_classes, self.speed.channels_last, config,
                                          finish=self.loaders.held_out_finish)
        if self.loaders.held_out_kept:
            self.evaluator.keep_batches(acc.prepare(pacer_for(self.loaders.held_out)))
        self.test_split = maybe_test_split(acc, self.loaders.test, self.bad_images,
                                           net.spec.num_classes, self.speed.channels_last, config,
                                           finish=self.loaders.test_finish)

    def _training_rate(self) -> float:
        """Images a second a copy of the run's model trains at on its device, at the run's batch
        and precision (--decode-on-device auto weighs the input paths against it)."""
        model = copy.deepcopy(self.net.model)
        time_step = step_timer(lambda: model, self.config.batch_size, self.net.spec.image_size,
                               self.net.spec.num_classes, max_batch=self.config.batch_size,
                               device=self.accelerator.device)
        return self.config.batch_size / time_step(self.precision, self.speed.channels_last)

    def _prepare_checkpointed_parts(self):
        """The run's state and the parts options turn on (each a no-op when off), and what
        every checkpoint holds and a resume restores, in this order: the checks that refuse a
        checkpoint (another model, other data) come before anything is loaded."""
        acc, config = self.accelerator, self.config
        self.state = TrainerState(world_size=acc.num_processes, batch_size=config.batch_size,
                                  accumulation_steps=config.accumulation_steps, seed=config.seed,
                                  train_samples=len(self.data.train), precision=self.precision,
                                  held_out_samples=len(self.data.held_out),
                                  test_samples=len(self.data.test)
                                  if self.data.test is not None else 0,
                                  channels_last=self.speed.channels_last,
                                  optimizer=config.optimizer,
                                  sample_subset=self.data.sample_subset or "all",
                                  held_out_carve=self.data.held_out_carve,
                                  eval_metric=config.eval_metric,
                                  # None where auto had nothing to choose
                                  decoded_on_device=self.loaders.decoded_on_device
                                  if self.loaders.decoding else None,
                                  host_decode_share=self.loaders.host_decode_share,
                                  photos_held=self.loaders.photos_held)
        self.class_weights = maybe_class_weights(config.class_weight, self.data.train,
                                                 self.data.class_names)
        self.mixup = maybe_mixup(config, self.net.spec.num_classes,
                                 None if self.class_weights is None
                                 else self.class_weights.to(acc.device))
        self.ema = maybe_ema(self.bare_model(), config, self.report.warn)
        self.lookahead = maybe_lookahead(self.bare_model(), config, lambda: self.total_steps,
                                         self.report.warn)
        self.checkpointer = Checkpointer(
            self.plan.checkpoint_dir, config.keep_checkpoints, self.report.warn,
            # the data's checks (state) before the network's (spec): other data also gives
            # other normalization statistics, and the data is what to name
            parts=[self.state, self.net.spec, self.train_loader,
                   AccelerateState(acc, self.report.warn, models=[self.bare_model()]),
                   self.schedule, self.ema, self.lookahead, self.bad_images],
            is_main=acc.is_main_process, barrier=acc.wait_for_everyone,
            keep_best=config.keep_best)
        self.cadence = CheckpointCadence(config.checkpoint_minutes)

    def _maybe_restore(self) -> Optional[tuple[float, float]]:
        """On resume, every checkpointed part from the plan's checkpoint; returns the change of
        --learning-rate against the checkpoint's run, if any (optim.take_new_learning_rate)."""
        if self.plan.resume_from is None:
            return None
        wanted = base_learning_rates(self.optimizer)  # what this start's flags built
        try:
            self.checkpointer.restore(self.plan.resume_from)
        except BadFile as err:
            # the same import path, another network: the user's code changed since, which is
            # likelier than an edited checkpoint (the file's own fix says that)
            name = self.net.spec.model_name
            if not (is_import_path(name) and err.problem.startswith(ANOTHER_MODELS_WEIGHTS)):
                raise
            raise UsageError(f"{self.plan.resume_from}: {err.problem}: --model {name} builds "
                             f"another network than the one this run trained; run with the "
                             f"factory as it was, or start a new run") from None
        return take_new_learning_rate(self.optimizer, self.scheduler, wanted)

    def _prepare_step_parts(self):
        """What acts after every optimizer step, in this order: the heartbeat and the collective
        timeouts, the time budget's fit, the lookahead and EMA averages, the log record.  After
        the restore: a resumed run's schedule says whether a budget still has to fit it."""
        acc, config = self.accelerator, self.config
        control_group = distributed.cpu_control_group(acc.num_processes)
        ranks = distributed.RankAgreement(control_group)
        self.stop = distributed.StopSignals(control_group)
        self.timeouts = CollectiveTimeouts(
            [None, *([control_group] if control_group is not None else [])],
            distributed.group_store(), acc.process_index, acc.num_processes,
            config.collective_timeout)
        self.metrics = MetricsLog(self.paths.metrics, acc.is_main_process)
        self.progress = Progress(acc.is_main_process, config.progress)
        self.pacer = maybe_pacer(config, self.schedule, self.loaders, len(self.data.held_out),
                                 lambda: self.evaluator.time_one_batch(self.bare_model()), ranks,
                                 self.report, self.metrics, self.progress, self._record_resolved)
        self.watch = StepWatch(self.timeouts, ranks.max, config.log_every)
        self.wait_clock = data_wait_clock(acc.device.type)
        self.train_log = TrainLog(acc, self.state, config.log_every, self.metrics, self.progress,
                                  self.wait_clock, self.bare_model(),
                                  self.optimizer, self.bad_images,
                                  lambda record: self.callbacks.on_log(self, record))
        self.step_parts = [self.watch, self.pacer, self.lookahead, self.ema, self.train_log]
        self.stem_bias = maybe_stem_bias_stop(self.bare_model(), config,  # before each update
                                              distributed=acc.num_processes > 1,
                                              device_type=acc.device.type)

    def _open_records(self, warnings: list[Optional[str]]):
        facts = resolved_facts(self.accelerator, self.config, self.plan, self.data, self.net,
                               self.loaders, self.speed, self.precision, self.cuda_math,
                               self.host_memory,
                               self.network_choice, self.pacer.known_total(self.total_steps),
                               self.class_weights)
        try:
            open_records(self.accelerator, self.plan, self.config, self.speed, self.state,
                         self.metrics, self.report, self.paths, facts, self.data.description,
                         self.learning_rate_change, warnings)
            self.bad_images.collect()  # those met while decoding into memory
        except BaseException:
            # The rank log opened in open_records: closed now, not left to the collector, for
            # from_config's build and for a program that built this Trainer from its own parts.
            self.report.close_log()
            raise

    def _record_resolved(self, facts: dict):
        """Facts resolved while training (a time budget's fit) into this start's record."""
        if self.accelerator.is_main_process:
            update_resolved(self.plan.output_dir, facts)

    def bare_model(self) -> torch.nn.Module:
        """The model without DDP's and torch.compile's wrappers: the parameter names of the
        model itself (a compiled model's state dict would prefix each with `_orig_mod.`)."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps

    # -- loop -----------------------------------------------------------------------------------
    def _ending_on(self, err: Exception) -> None:
        """An error ends the loop: its traceback into this rank's log, and a word in the store
        for the ranks it leaves waiting (collectives.note_crash)."""
        self.report.log_exception("the run stopped on an error")
        self.timeouts.note_crash(self.state.step, err)

    def train(self) -> int:
        """Epochs until the schedule's steps are trained (or a stop signal or a stalled rank
        ends the run); returns the process exit code."""
        state = self.state
        if self.finished_before:
            self.report.say(f"{self.plan.output_dir} finished: it trained its {state.step} steps "
                            f"and saved its model; nothing to do. To train on, give more "
                            f"--epochs or --max-steps; accel-train eval {self.plan.output_dir} "
                            f"evaluates it")
            return 0
        # Resumed at its last step: evaluated there (killed in its end: the final model and the
        # test split's one evaluation still to do, or done), or stopped by a signal there
        # (that step's end still to do).
        at_end = state.step >= self.total_steps
        evaluated_at_end = self._evaluated_at_end()
        self.callbacks.on_train_begin(self)
        self.accelerator.wait_for_everyone()  # every rank's callbacks began before any trains
        self.progress.start(self.pacer.known_total(self.total_steps), state.step)
        started = time.perf_counter()
        self.pacer.start(state.step)
        with self.stop.handlers_installed():
            try:
                while state.step < self.total_steps:
                    epoch_started = time.perf_counter()
                    if self.train_epoch():
                        return self._stop_for_signal()
                    # --max-steps or a time budget may end the run inside the epoch
                    self.end_epoch(time.perf_counter() - epoch_started,
                                   mid_epoch=not self._epoch_used_up())
                if at_end and not evaluated_at_end and state.samples_in_epoch:
                    self.end_epoch(mid_epoch=not self._epoch_used_up())
            except RuntimeError as err:
                if not (self.timeouts.active and is_timeout(err)):
                    self._ending_on(err)
                    raise
                return report_stall(self.timeouts, err, state.step, self.accelerator.process_index,
                                    self.paths.logs / f"rank{self.accelerator.process_index}.log",
                                    self.report)
            except Exception as err:
                self._ending_on(err)
                raise
            finally:
                self.progress.close()
        self.train_log.stop_if_nothing_learned("model.safetensors")
        self.timeouts.relax()
        self.checkpointer.wait()  # the last checkpoint sealed before the end's words
        self.pacer.finish(state.step)
        self.report.say(f"Training took {time.perf_counter() - started:.1f}s")
        self._finish(tested=evaluated_at_end and distributed.decide_on_main(
            lambda: tested_at(self.plan.output_dir, state.step)))
        return 0

    def _evaluated_at_end(self) -> bool:
        """Whether this start stands at the run's last step, evaluated there (the state as
        restored: a fresh run stands at step 0)."""
        return self.state.step >= self.total_steps and self.state.eval_step == self.state.step

    def _epoch_used_up(self) -> bool:
        """Whether the epoch's samples are all trained (its last batch taken)."""
        return self.state.samples_in_epoch >= self.train_loader.usable

    # -- accumulate -----------------------------------------------------------------------------
    def train_epoch(self) -> bool:
        """Run (the rest of) the current epoch; True if a stop signal ended it early."""
        acc, state = self.accelerator, self.state
        set_train_mode(self.model, self.config.freeze_backbone)
        per_micro_step = self.config.batch_size * acc.num_processes
        self.watch.start_epoch(state.step)
        self.train_log.start_epoch()
        batches = iter(self.train_loader)  # from where the loader stands in its epoch
        while state.step < self.total_steps:
            self.wait_clock.before_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                break
            self.wait_clock.after_fetch()
            self.bad_images.note("train", batch.replaced, batch.labels)
            self.callbacks.on_batch_start(self, batch)
            with acc.accumulate(self.model):
                loss, num_correct = self.train_step(batch.images, batch.labels)
            self.train_log.add(loss, num_correct, per_micro_step)
            state.samples_in_epoch = self.train_loader.samples_in_epoch
            state.samples_seen += per_micro_step
            if not acc.sync_gradients:
                continue
            # fp16 overflow: the lr waits too, where the host learns of it (a fused
            # optimizer skips the update on the GPU unread, and the lr goes on: optim.py)
            if not self.optimizer.step_was_skipped:
                self.scheduler.step()
            state.step += 1
            for part in self.step_parts:
                part.after_step(state.step)
            self.callbacks.on_step_end(self, state.step)
            if self.stop.agreed():
                return True
            self.maybe_checkpoint("step")
        return False

    # -- step -----------------------------------------------------------------------------------
    def train_step(self, images: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward, backward, and (on the last micro-step) the update.
        Returns the loss and how many of the images the model got right (the running train
        accuracy costs one argmax; it is measured on augmented images, in train mode)."""
        # The micro-batch's place in the run: every draw from here to the update (Mixup/CutMix,
        # dropout and drop-path inside the model) is a function of it, not of what drew before.
        position = (self.state.epoch, self.state.samples_in_epoch, self.accelerator.process_index)
        seed_globals(self.config.seed, *position, MICRO_BATCH_SALT)
        images, targets = self.mixup(images, labels, position)
        if self.speed.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with self.accelerator.autocast(), \
                naming_skipped_parameters(self.state.step + 1, self.config.model):
            logits = self.model(images)
            loss = self.mixup.loss_fn(logits, targets)
            # --aux-loss-weight: the auxiliary heads' logits this forward set aside (outputs.py)
            for auxiliary in kept_auxiliary_logits(self.net.model):
                loss = loss + self.config.aux_loss_weight * self.mixup.loss_fn(auxiliary, targets)
        self.accelerator.backward(loss)
        self.stem_bias.before_update(self.state.epoch)
        if self.config.grad_clip and self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()  # Accelerate makes these no-ops until the accumulation completes
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), (logits.detach().argmax(dim=1) == labels).sum()

    # -- evaluate -------------------------------------------------------------------------------
    def end_epoch(self, epoch_seconds: Optional[float] = None, mid_epoch: bool = False):
        """The epoch is over (`epoch_seconds`: it was timed whole): evaluate when --eval-every
        says so, record it, stand at the next epoch, checkpoint.  Outside the time budget's
        window of steps, which measures it apart.  `mid_epoch`: the run's steps ended inside
        the epoch: the checkpoint stays where the epoch stands, so that a longer run resumed
        from it trains the rest of the epoch instead of skipping it."""
        state = self.state
        self.timeouts.relax()  # evaluation and checkpoint: healthy long waits
        self.train_log.end_epoch()
        last = state.step >= self.total_steps
        evaluates = self.evaluator.due(state.epoch, last=last)
        best_before = state.best_score
        with self.pacer.paused(evaluates):
            if last:  # what is finally evaluated and saved is the average
                self.lookahead.at_training_end()
            record = {"type": "epoch", "epoch": state.epoch + 1, "step": state.step}
            began = time.perf_counter()
            words = (self._evaluate_into(record) if evaluates else
                     f"not evaluated (--eval-every {self.config.eval_every})")
            if evaluates:  # what --time-budget's estimate of it is read against
                record["eval_time"] = round(time.perf_counter() - began, 3)
            if epoch_seconds is not None:
                record["epoch_time"] = round(epoch_seconds, 3)
            record["bad_images"] = self.bad_images.collect()
            if self.accelerator.is_main_process and not mid_epoch:  # every image met
                self.bad_images.after_epoch()
            self.metrics.write(record)
            self.accelerator.log(tracker_scalars(record), step=state.step)
            timing = f" Time {epoch_seconds:.1f}s" if epoch_seconds is not None else ""
            self.progress.write(f"Epoch {state.epoch + 1}{timing}: {words}")
            # the log too: a run started detached (nohup, --progress none) keeps its numbers
            self.report.log(f"Epoch {state.epoch + 1}{timing}: {words}")
            if not mid_epoch:
                self.next_epoch()
            self.maybe_checkpoint("the last step, mid-epoch" if mid_epoch else "epoch end",
                                  new_best=state.best_score != best_before)

    def _evaluate_into(self, record: dict) -> str:
        """The model's evaluation and the averages' beside it (--model-ema), into the state and
        `record`; returns the console's words for them."""
        results = {"": self.evaluate()}
        results.update({name: self.evaluate(average)
                        for name, average in self.ema.averaged().items()})
        evaluated = epoch_record(results)
        record.update(evaluated)
        self.state.note_evaluation(evaluated)
        self.callbacks.on_evaluate(self, evaluated)
        return epoch_words(results, self.config.eval_metric)

    def evaluate(self, model: Optional[torch.nn.Module] = None) -> dict:
        """Loss, top-1, top-5 and per-class accuracy over the whole held-out split, each sample
        once (train/evaluate.py; `accel-train eval` computes the same numbers the same way), of
        the trained model or of `model` (an average)."""
        return self.evaluator.evaluate(self.bare_model() if model is None else model,
                                       self.state.step)

    def next_epoch(self):
        """The state and the train loader both stand at the next epoch."""
        self.state.epoch += 1
        self.state.samples_in_epoch = 0
        self.train_loader.set_epoch(self.state.epoch)

    # -- checkpoint -----------------------------------------------------------------------------
    def maybe_checkpoint(self, event: str, process_ends: bool = False,
                         new_best: bool = False) -> Optional[Path]:
        """The one place that decides when to save: at epoch ends (after evaluating, so the
        checkpoint's best top-1 is current; with --checkpoint-minutes only where that long has
        passed, or at the last step, or at a `new_best` --keep-best keeps), on an agreed stop
        signal, and every --checkpoint-every optimizer steps in between (not at an epoch's
        last step or the run's last step: the epoch end saves those).  `process_ends`:
        nothing follows the save but the process's exit, so it is sealed in line."""
        state = self.state
        if event == "step":
            every = self.config.checkpoint_every
            if not every or state.step % every or self._epoch_used_up() \
                    or state.step >= self.total_steps:
                return None
        elif event == "epoch end" and not self.cadence.epoch_end_saves(
                must=state.step >= self.total_steps or (new_best and self.config.keep_best > 0)):
            return None
        with self.timeouts.relaxed():  # rank 0 writes; the others wait at its barrier
            # Sealed on a thread while training goes on (save_finishing.py).
            return self.save_checkpoint(event, background=not process_ends)

    def save_checkpoint(self, why: str = "asked", background: bool = False) -> Path:
        """Save now (every rank calls it together); `maybe_checkpoint` decides when.
        `background`: return once every part is written, and seal the checkpoint (manifest,
        rename, pruning) on a thread of the main process; sealed in line all the same where a
        callback's on_checkpoint is to see it complete."""
        stop_if_diverged(self.bare_model(), self.state.step, f"the checkpoint ({why})")
        self.cadence.saved()  # (from the save's start: its own seconds count as passed)
        path = self.checkpointer.save(
            background=background and not self.callbacks.watch_checkpoints,
            sealed=lambda path: self.report.log(f"saved checkpoint {path} ({why})"))
        self.callbacks.on_checkpoint(self, path)
        return path

    def _stop_for_signal(self) -> int:
        self.timeouts.relax()
        self.bad_images.collect()
        path = self.maybe_checkpoint("stop signal", process_ends=True)
        self.report.say(f"stopped by a signal at step {self.state.step}: saved {path}; run the "
                        f"same command with --resume auto to continue")
        return STOPPED_EXIT

    # -- the end --------------------------------------------------------------------------------
    def _finish(self, tested: bool = False):
        """The final model (the better of the raw and EMA weights), the plots, the last words.
        `tested`: a start before this one evaluated the test split with these weights."""
        if self.bad_images.summary():
            self.report.say(self.bad_images.summary())
        saved = save_final_model(self.accelerator, self.bare_model(), self.ema.averaged(),
                                 self.state, self.net.spec, self.plan.output_dir, self.report)
        if not tested:
            self._maybe_test(saved)
        maybe_plot(self.config.plots, self.accelerator.is_main_process, self.plan.output_dir,
                   self.report)
        say_next(self.state.best_words(), self.plan.output_dir, self.report,
                 data_from_program=self.data.from_program,
                 rebuilt_by_commands=self.net.rebuilt_by_commands)
        self.callbacks.on_train_end(self)

    def _maybe_test(self, saved: torch.nn.Module):
        """The test split, once, with the saved weights (none: nothing to do)."""
        with self.timeouts.relaxed():
            results = self.test_split.evaluate_once(saved, self.state.step)
            self.bad_images.collect()  # what the test split's files held (every rank calls)
        if results is not None:
            self.metrics.write(test_record(results, self.state.step))
            self.report.say(f"test top-1 {results['top1']:.2%} top-5 {results['top5']:.2%} "
                            f"({results['count']} images of the test split, evaluated once, "
                            f"with the saved weights)")

    def close(self):
        try:
            self._last_checkpoint_sealed()
            # Now, not when the collector gets to them: loaders.end_workers says why.
            self.train_loader.close()
            end_workers(self.held_out_loader)
            # What Accelerator.end_training does but destroy the default process group, which
            # may be the calling program's own: distributed.teardown destroys the run's.
            for tracker in self.accelerator.trackers:
                tracker.finish()
        finally:
            self.plan.release()
            if self.logits_hook is not None:
                self.logits_hook.remove()
            self.report.close_log()

    def _last_checkpoint_sealed(self) -> None:
        """A checkpoint still being sealed when an error, a stall or a stop ends the run is
        completed before the process goes on to end; what failed in it is said, not raised:
        the run's own ending is the one to tell."""
        try:
            self.checkpointer.wait()
        except Exception as err:
            self.report.warn(f"the last checkpoint was not completed: {first_line(err)}")


@dataclasses.dataclass
class RunOutcome:
    exit_code: int   # 0, or the process's code after a stop signal (143) or a stalled rank
    output_dir: Path


def train_and_close(config: TrainConfig, callbacks: Iterable[Callback] = (), **brought
                    ) -> RunOutcome:
    """Build, train, close: the whole `train` command, and the Python API's run (`brought`:
    `Trainer.from_config`'s `bring_data` and `model`)."""
    check_trackers(config.report_to)  # accelerate would ignore a missing one, or raise later
    trainer = None
    try:
        trainer = Trainer.from_config(config, callbacks, **brought)
        return RunOutcome(trainer.train(), trainer.plan.output_dir)
    finally:
        run = None
        if trainer is not None:
            run = weakref.ref(trainer)
            trainer.close()
        trainer = None  # its reference cycles hold the process groups: teardown frees them
        distributed.teardown(run)


def run_training(config: TrainConfig, callbacks: Iterable[Callback] = ()) -> int:
    """The `train` command (and a program's run of the same options with its callbacks):
    its exit code."""
    return train_and_close(config, callbacks).exit_code
