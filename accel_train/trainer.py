"""The training loop on Accelerate: prepare, accumulate, autocast, evaluate with
gather_for_metrics, checkpoint, resume.

Every rank-sensitive act goes through the Accelerator: printing and writing shared files happen on
the main process, `wait_for_everyone` precedes reading what another rank wrote.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration
from safetensors.torch import save_file

from . import distributed
from .checkpoint import (Checkpointer, TrainerState, accumulation_for, check_fresh_checkpoint_dir,
                         check_same_data_order, read_state, record_elastic_job, resolve_resume,
                         set_aside_newer, started_by_elastic_job)
from .config import TrainConfig
from .data import (EpochSampler, EvalImages, TrainImages, dataset_mean_std, default_num_workers,
                   make_loader)
from .errors import UsageError
from .evaluate import evaluate_classifier
from .model import (WEIGHTS_FILE, ModelSpec, check_image_size, create_model, freeze_backbone,
                    pretrained_normalization, set_train_mode)
from .optim import build_optimizer, build_scheduler
from .plots import PLOTS_DIR, write_plots
from .rundir import prepare_output_dir, write_run_config
from .sources import ArraySource, load_data
from .syncbn import convert_sync_batchnorm, num_batchnorm_layers
from .testhooks import SampleLog, WithSampleKeys, maybe_sample_log, sample_log_enabled
from .track import (METRICS_FILE, TRACKERS_DIR, MetricsLog, Progress, check_trackers, rank_logger,
                    tracker_scalars)
from .transforms import ImageTransform


def resolve_precision(requested: str, cuda: bool,
                      activity: str = "trains") -> tuple[str, Optional[str]]:
    """The precision that will really run, and a warning when it is not the one asked for
    (`activity`: what this run does in that precision, "trains" or "evaluates")."""
    if requested == "fp16" and not cuda:
        return "no", (f"--mixed-precision fp16 needs a CUDA device; this run {activity} in fp32 "
                      "(use --mixed-precision bf16 for reduced precision on CPU)")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        return "no", f"this GPU has no bf16 support; this run {activity} in fp32"
    return requested, None


def _agree(compute):
    """Run `compute` on global rank 0 and give its result (or its UsageError) to all ranks,
    so that decisions about shared files are made once and never diverge across ranks.
    Works before the Accelerator exists (distributed.setup has started the process group):
    the resume decision must be made before the Accelerator fixes the accumulation steps."""
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    result: list = [None]
    if not group or dist.get_rank() == 0:
        try:
            result[0] = ("ok", compute())
        except UsageError as err:
            result[0] = ("error", str(err))
    if group:
        dist.broadcast_object_list(result, src=0)
    kind, value = result[0]
    if kind == "error":
        raise UsageError(value)
    return value


def main_first(compute):
    """Run `compute` on rank 0 first, then on the other ranks (datasets builds its Arrow cache
    once).  Unlike `accelerator.main_process_first`, a UsageError on rank 0 reaches every rank
    at once, instead of leaving them at a barrier until the 30-minute collective timeout."""
    result = {}

    def on_main():
        result["value"] = compute()

    _agree(on_main)
    return result["value"] if "value" in result else compute()


def _resume_policy(config: TrainConfig, env: distributed.LauncherEnv) -> Optional[str]:
    """--resume as given; else 'auto' in a new round of a torchelastic job that already trained
    here: a worker its agent restarted (TORCHELASTIC_RESTART_COUNT > 0), or any worker of the
    job that started this output directory (see checkpoint.started_by_elastic_job).  Decided by
    all ranks together: restart counts are per machine, and ranks that disagreed about resuming
    would deadlock in their first collective."""
    if config.resume is not None:
        return config.resume
    continues = env.restart_count > 0 or started_by_elastic_job(config.output_dir, env.run_id)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        votes: list = [None] * dist.get_world_size()
        dist.all_gather_object(votes, continues)
        continues = any(votes)
    return "auto" if continues else None


def print_on_main(accelerator: Optional[Accelerator], text: str):
    """Print on the global main process only, also before the Accelerator is built (the resume
    decision).  Not `accelerator.print`: that prints once per *machine* (local main process),
    so a 2-machine run, or the manual --rank start where every process is local rank 0, would
    print everything twice."""
    if accelerator is not None:
        if accelerator.is_main_process:
            print(text, flush=True)
    elif not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(text, flush=True)


class Trainer:
    def __init__(self, config: TrainConfig, env: distributed.LauncherEnv):
        self.config = config
        check_trackers(config.report_to)  # accelerate would ignore a missing one, or raise later
        self.logger = None  # created once the start is known good: a failed start writes nothing
        self.accelerator = None  # built once the resume point is known (it fixes accumulation)
        self._unlogged: list[str] = []  # warnings given before the log file exists
        cuda = torch.cuda.is_available()
        self.precision, precision_warning = resolve_precision(config.mixed_precision, cuda)

        resume = _resume_policy(config, env)
        self.output_dir = Path(_agree(lambda: prepare_output_dir(config, resume, env)))
        self.checkpoint_dir = Path(config.checkpoint) if config.checkpoint else \
            self.output_dir / "checkpoints"
        # The checkpoint's global batch decides the accumulation steps on this many processes,
        # and the Accelerator takes them at construction: choose the resume point first.
        resume_from = _agree(lambda: self._choose_resume_point(resume))
        self.resumed = read_state(Path(resume_from)) if resume_from else None
        if self.resumed is not None:
            self.config = config = self._keep_global_batch(config, self.resumed, env.world_size)

        ddp_kwargs = DistributedDataParallelKwargs(
            find_unused_parameters=False, bucket_cap_mb=config.ddp_bucket_mb,
            gradient_as_bucket_view=config.ddp_grad_as_bucket_view,
            static_graph=config.ddp_static_graph)
        self.accelerator = acc = Accelerator(
            cpu=not cuda, mixed_precision=self.precision,
            gradient_accumulation_steps=config.accumulation_steps,
            step_scheduler_with_optimizer=False,  # we step it once per optimizer step (optim.py)
            log_with=config.report_to or None, kwargs_handlers=[ddp_kwargs],
            # compiled after DDP wrapping, inside prepare (what DDP's optimizer for dynamo expects)
            dynamo_backend="inductor" if config.compile else None,
            # file-writing trackers (tensorboard, ...) write into the run: <run>/trackers/
            project_config=ProjectConfiguration(logging_dir=str(self.output_dir / TRACKERS_DIR)))
        if acc.num_processes != env.world_size:
            raise RuntimeError(f"Accelerate sees {acc.num_processes} processes but the launcher "
                               f"started {env.world_size}: the process group was not shared")
        self.checkpointer = Checkpointer(acc, self.checkpoint_dir, config.keep_checkpoints,
                                         self.warn)
        acc.register_save_state_pre_hook(self._save_spec_into_checkpoint)

        self.data = main_first(lambda: load_data(config))
        self._build_model()
        self._build_loaders()
        self._build_optimization()
        self.model, self.optimizer, self.train_loader, self.eval_loader, self.scheduler = \
            acc.prepare(self.model, self.optimizer, self.train_loader, self.eval_loader,
                        self.scheduler)

        self.state = TrainerState(world_size=acc.num_processes, batch_size=config.batch_size,
                                  accumulation_steps=config.accumulation_steps, seed=config.seed,
                                  train_samples=len(self.data.train))
        self.logger = rank_logger(self.output_dir / "logs", acc.process_index)
        self.logger.info(distributed.describe_process())  # which rank of which group wrote this
        for text in self._unlogged:
            self.logger.warning(text)
        self.metrics = MetricsLog(self.output_dir / METRICS_FILE, acc.is_main_process)
        self.sample_log = maybe_sample_log(self.output_dir / "logs", acc.process_index)
        if resume is not None:
            self._maybe_resume(resume_from)
        if acc.is_main_process:
            write_run_config(self.output_dir, config, self._resolved_facts())
            record_elastic_job(self.output_dir, env.run_id)
        if config.report_to:
            acc.init_trackers("accel_train", config={k: v for k, v in config.to_dict().items()
                                                     if isinstance(v, (int, float, str, bool))})
        self._stop_signal: Optional[int] = None
        # The ranks agree on stopping once per optimizer step.  On a CPU (gloo) group, so that
        # under NCCL the one-number all-reduce and its .item() do not make the host wait for the
        # GPU every step (the loop otherwise never syncs per step; see _Window).  Every rank
        # builds it here, in the same order, as new_group requires.
        self._control_group = (dist.new_group(backend="gloo") if acc.num_processes > 1
                               else None)
        if precision_warning:
            self.warn(precision_warning)
        launch_warning = distributed.single_process_launch_warning()
        if launch_warning:
            self.warn(launch_warning)
        self._print_summary()

    # -- construction -------------------------------------------------------------------------
    def _build_model(self):
        config, data = self.config, self.data
        image_size = config.image_size or data.train.native_size
        torch.manual_seed(config.seed)  # model init is a function of --seed alone
        model = create_model(config.model, len(data.class_names), config.drop_rate,
                             config.pretrained)
        check_image_size(model, config.model, image_size)
        if config.pretrained:
            mean, std = pretrained_normalization(model)
        else:
            mean, std = dataset_mean_std(data.train)
        self.spec = ModelSpec(config.model, len(data.class_names), list(data.class_names),
                              image_size, tuple(mean), tuple(std), config.drop_rate)
        self.num_trainable = (freeze_backbone(model) if config.freeze_backbone
                              else sum(p.numel() for p in model.parameters()))
        self.sync_bn = config.sync_bn and self.accelerator.num_processes > 1
        if self.sync_bn:
            convert_sync_batchnorm(model, cuda=self.accelerator.device.type == "cuda")
        if config.sync_bn and num_batchnorm_layers(model) == 0:
            self.warn(f"--sync-bn: {config.model} has no BatchNorm layers; nothing to sync")
        if config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model

    def _build_loaders(self):
        config, acc, spec = self.config, self.accelerator, self.spec
        train_tf = ImageTransform(spec.image_size, spec.mean, spec.std, augment=config.augment)
        eval_tf = ImageTransform(spec.image_size, spec.mean, spec.std, augment=False)
        global_batch = config.batch_size * acc.num_processes * config.accumulation_steps
        if len(self.data.train) < global_batch:
            raise UsageError(f"the training set has {len(self.data.train)} images, fewer than one "
                             f"global batch of {global_batch} (batch_size x processes x "
                             f"accumulation_steps); lower --batch-size")
        if len(self.data.eval) == 0:
            raise UsageError("the held-out split is empty; raise --val-fraction or "
                             "--max-eval-samples")
        local_procs = distributed.LauncherEnv.from_environ().local_world_size
        workers = config.num_workers if config.num_workers is not None else \
            default_num_workers(self.data.train, local_procs)
        pin = acc.device.type == "cuda"
        self.sampler = EpochSampler(len(self.data.train), global_batch, config.seed)
        train_set = TrainImages(self.data.train, train_tf, config.seed)
        if sample_log_enabled():  # test hook: each batch also carries its sampler keys
            train_set = WithSampleKeys(train_set)
        self.train_loader = make_loader(train_set,
                                        config.batch_size, workers, config.prefetch_factor,
                                        config.persistent_workers, pin, sampler=self.sampler,
                                        drop_last=True)
        self.eval_loader = make_loader(EvalImages(self.data.eval, eval_tf), config.batch_size,
                                       workers, config.prefetch_factor, config.persistent_workers,
                                       pin)
        self.num_workers = workers
        micro_per_epoch = self.sampler.usable // (config.batch_size * acc.num_processes)
        self.steps_per_epoch = micro_per_epoch // config.accumulation_steps
        self.global_batch = global_batch

    def _build_optimization(self):
        config = self.config
        self.optimizer = build_optimizer(self.model, config)
        total = config.epochs * self.steps_per_epoch
        if config.max_steps is not None:
            total = min(total, config.max_steps)
        self.total_steps = total
        warmup = round(config.warmup_epochs * self.steps_per_epoch)
        self.scheduler = build_scheduler(self.optimizer, min(warmup, total), total)
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)

    def _choose_resume_point(self, resume: Optional[str]) -> Optional[str]:
        """Main process, before any rank reads the checkpoint folder: the checkpoint to resume
        from (None: start afresh), with killed saves finished or discarded and checkpoints of
        a later step set aside (that future is about to be redone)."""
        if resume is None:
            check_fresh_checkpoint_dir(self.checkpoint_dir)
            return None
        path = resolve_resume(self.checkpoint_dir, resume, self.warn)
        if path is not None:
            set_aside_newer(self.checkpoint_dir, read_state(path).step, self.warn)
        return None if path is None else str(path)

    def _keep_global_batch(self, config: TrainConfig, previous: TrainerState,
                           num_processes: int) -> TrainConfig:
        """The global batch is part of the run: on another number of processes (or with another
        --batch-size) the accumulation steps change so that it stays what it was."""
        accumulation = accumulation_for(previous, config.batch_size, num_processes)
        if accumulation == config.accumulation_steps:
            return config
        self.print(f"resuming a global batch of {previous.global_batch} on {num_processes} "
                   f"process(es) x {config.batch_size}: accumulation steps "
                   f"{config.accumulation_steps} -> {accumulation}")
        return dataclasses.replace(config, accumulation_steps=accumulation)

    def _maybe_resume(self, path: Optional[str]):
        acc = self.accelerator
        if path is None:
            self.print("no valid checkpoint found: starting from scratch")
            # Anything logged belongs to an attempt that left no checkpoint: it will be redone.
            self._forget_steps_after(0)
            return
        check_same_data_order(self.resumed, self.config.seed, len(self.data.train))
        previous = self.checkpointer.load(Path(path))
        self.state.step, self.state.epoch = previous.step, previous.epoch
        self.state.samples_in_epoch = previous.samples_in_epoch
        self.state.samples_seen, self.state.best_top1 = previous.samples_seen, previous.best_top1
        # Accelerate counts micro-steps to know when to sync; a resume is always at an optimizer
        # step boundary, and the accumulation count may have changed with the world size.
        acc.step = 0
        self._forget_steps_after(previous.step)
        self.metrics.write({"type": "resume", "step": previous.step, "from": str(path),
                            "world_size": acc.num_processes,
                            "previous_world_size": previous.world_size,
                            "accumulation_steps": self.config.accumulation_steps})
        self.print(f"resumed from {path} at step {previous.step} (epoch {previous.epoch + 1}, "
                   f"{previous.samples_in_epoch} samples into it)")

    def _forget_steps_after(self, step: int):
        """Logs read as if the run had never stopped: what came after `step` is redone."""
        self.metrics.truncate_after(step)
        if self.sample_log is not None and self.accelerator.is_main_process:
            SampleLog.truncate_after(self.output_dir / "logs", step)
        self.accelerator.wait_for_everyone()  # before any rank appends again

    # -- reporting ----------------------------------------------------------------------------
    def print(self, text: str):
        if self.logger is not None:
            self.logger.info(text)
        print_on_main(self.accelerator, text)

    def warn(self, text: str):
        if self.logger is not None:
            self.logger.warning(text)
        else:
            self._unlogged.append(text)
        print_on_main(self.accelerator, f"warning: {text}")

    def _resolved_facts(self) -> dict:
        acc = self.accelerator
        return {"precision_used": "fp32" if self.precision == "no" else self.precision,
                "precision_requested": self.config.mixed_precision,
                "device": str(acc.device), "distributed_type": str(acc.distributed_type),
                "world_size": acc.num_processes, "global_batch": self.global_batch,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "train_samples": len(self.data.train), "eval_samples": len(self.data.eval),
                "num_workers": self.num_workers, "data_in_memory": isinstance(self.data.train,
                                                                             ArraySource),
                "sync_bn": self.sync_bn, "model": self.spec.__dict__,
                "trainable_parameters": self.num_trainable,
                "launcher": distributed.launcher_facts(),
                "output_dir": str(self.output_dir), "checkpoint_dir": str(self.checkpoint_dir)}

    def _print_summary(self):
        facts, acc = self._resolved_facts(), self.accelerator
        backend = f", {torch.distributed.get_backend()}" if acc.num_processes > 1 else ""
        self.print(
            f"accel_train: {self.spec.model_name} ({self.num_trainable:,} trainable parameters) "
            f"on {self.data.description}\n"
            f"  device {facts['device']} x {acc.num_processes} process(es){backend}; precision "
            f"{facts['precision_used']}; sync-bn {'on' if self.sync_bn else 'off'}\n"
            f"  data: {facts['train_samples']} train / {facts['eval_samples']} held-out images, "
            f"{len(self.spec.class_names)} classes, {self.spec.image_size}px, "
            f"{'decoded in memory' if facts['data_in_memory'] else 'decoded per step'}, "
            f"{self.num_workers} loader worker(s)\n"
            f"  global batch {self.global_batch} = {self.config.batch_size} per process x "
            f"{acc.num_processes} process(es) x {acc.gradient_accumulation_steps} accumulation "
            f"step(s); "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps in all\n"
            f"  output: {self.output_dir} (checkpoints in {self.checkpoint_dir})\n"
            f"  records: {self._records_text()}")

    def _records_text(self) -> str:
        """What the run records besides checkpoints, and where."""
        parts = [METRICS_FILE]
        if self.config.report_to:
            parts.append(f"{' + '.join(self.config.report_to)} (files in {TRACKERS_DIR}/)")
        if self.config.plots:
            parts.append(f"PNG curves at the end in {PLOTS_DIR}/")
        return ", ".join(parts)

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> int:
        """Train to the end (or to a stop signal); returns the process exit code."""
        acc, config = self.accelerator, self.config
        previous_handlers = {sig: signal.signal(sig, self._request_stop)
                             for sig in (signal.SIGTERM, signal.SIGINT)}
        self.progress = Progress(acc.is_main_process, config.progress, self.total_steps,
                                 self.state.step)
        started = time.perf_counter()
        try:
            while self.state.epoch < config.epochs and self.state.step < self.total_steps:
                epoch_started = time.perf_counter()
                stopped = self.train_epoch()
                if stopped:
                    return self._stop_for_signal()
                self._end_epoch(time.perf_counter() - epoch_started)
            if self.state.samples_in_epoch:  # --max-steps ended mid-epoch
                self._end_epoch(None)
        finally:
            self.progress.close()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        self.print(f"Training took {time.perf_counter() - started:.1f}s")
        self.save_model()
        self._maybe_plot()
        out = self.output_dir
        self.print(f"best held-out top-1 {self.state.best_top1 or 0:.2%}; next: accel-train eval "
                   f"{out}  |  accel-train predict {out} IMAGES...  |  accel-train plot {out}")
        return 0

    def train_epoch(self) -> bool:
        """Run (the rest of) the current epoch; True if a stop signal ended it early."""
        acc, config, state = self.accelerator, self.config, self.state
        set_train_mode(self.model, config.freeze_backbone)
        self.train_loader.set_epoch(state.epoch)
        loader = self.train_loader
        per_micro_step = config.batch_size * acc.num_processes
        skip = state.samples_in_epoch // per_micro_step
        if skip:
            loader = acc.skip_first_batches(self.train_loader, skip)
            loader.set_epoch(state.epoch)  # the skipping loader starts its own epoch count at 0
        window = _Window()
        batches = iter(loader)
        while state.step < self.total_steps:
            wait_started = time.perf_counter()
            try:
                images, labels, *sample_keys = next(batches)
            except StopIteration:
                break
            window.data_wait += time.perf_counter() - wait_started
            if self.sample_log is not None:
                self.sample_log.record(state.step + 1, sample_keys[0])
            with acc.accumulate(self.model):
                loss, num_correct = self.train_step(images, labels)
            window.add(loss, num_correct, per_micro_step)
            state.samples_in_epoch += per_micro_step
            state.samples_seen += per_micro_step
            if not acc.sync_gradients:
                continue
            if not self.optimizer.step_was_skipped:  # fp16 overflow: the lr waits too
                self.scheduler.step()
            state.step += 1
            if state.step % config.log_every == 0:
                self._log_window(window)
                window = _Window()
            if self._stop_requested_anywhere():
                return True
            end_of_epoch = state.samples_in_epoch >= self.sampler.usable
            if config.checkpoint_every and state.step % config.checkpoint_every == 0 \
                    and not end_of_epoch and state.step < self.total_steps:
                self.save_checkpoint()
        return False

    def train_step(self, images: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward, backward, and (on the last micro-step) the update.
        Returns the loss and how many of the images the model got right (the running train
        accuracy costs one argmax; it is measured on augmented images, in train mode)."""
        if self.config.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with self.accelerator.autocast():
            logits = self.model(images)
            loss = self.loss_fn(logits, labels)
        self.accelerator.backward(loss)
        if self.config.grad_clip and self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()  # Accelerate makes these no-ops until the accumulation completes
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), (logits.detach().argmax(dim=1) == labels).sum()

    def _end_epoch(self, epoch_seconds: Optional[float]):
        state = self.state
        results = self.evaluate()
        state.best_top1 = max(results["top1"], state.best_top1 or 0.0)
        record = {"type": "epoch", "epoch": state.epoch + 1, "step": state.step,
                  **{f"eval_{k}": v for k, v in results.items() if k != "per_class"}}
        if epoch_seconds is not None:
            record["epoch_time"] = round(epoch_seconds, 3)
        self.metrics.write(record)
        self.accelerator.log(tracker_scalars(record), step=state.step)
        timing = f" Time {epoch_seconds:.1f}s" if epoch_seconds is not None else ""
        self.progress.write(f"Epoch {state.epoch + 1}{timing}: eval loss {results['loss']:.4f} "
                            f"top1 {results['top1']:.2%} top5 {results['top5']:.2%} "
                            f"({results['count']} images)")
        state.epoch += 1
        state.samples_in_epoch = 0
        self.save_checkpoint()

    def evaluate(self, loader=None) -> dict:
        """Loss, top-1, top-5 and per-class accuracy over the whole held-out split, each sample
        once (see evaluate.py; `accel-train eval` computes the same numbers the same way)."""
        loader = self.eval_loader if loader is None else loader
        # The bare module: no DDP buffer broadcast, so no collective inside forward.
        model = self.accelerator.unwrap_model(self.model)
        if self.accelerator.num_processes > 1:
            # DDP hands rank 0's buffers (BatchNorm running statistics) to the other ranks only
            # at the next training forward; until then each rank holds the statistics of its
            # own last batch.  Every shard is evaluated with rank 0's, the ones the checkpoint
            # and model.safetensors keep (and the ones training continues with anyway).
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        return evaluate_classifier(self.accelerator, model, loader, self.spec.num_classes,
                                   self.config.channels_last)

    # -- logging, checkpoints, signals --------------------------------------------------------
    def _log_window(self, window: "_Window"):
        acc, state = self.accelerator, self.state
        loss = acc.reduce(torch.stack(window.losses).mean().to(acc.device), "mean").item()
        correct = acc.reduce(torch.stack(window.correct).sum().to(acc.device), "sum").item()
        elapsed = time.perf_counter() - window.started
        record = {"type": "train", "step": state.step, "epoch": state.epoch + 1,
                  "loss": round(loss, 6), "top1": round(correct / window.samples, 4),
                  "lr": self.scheduler.get_last_lr()[0],
                  "img_per_s": round(window.samples / elapsed, 2),
                  "data_wait": round(window.data_wait / elapsed, 4),
                  "samples_seen": state.samples_seen}
        self.metrics.write(record)
        self.accelerator.log(tracker_scalars(record), step=state.step)
        self.progress.update(state.step, record)

    def _save_spec_into_checkpoint(self, models, weights, output_dir: str):
        """Accelerate calls this inside save_state, before our manifest is written: every
        checkpoint then carries model_config.json, so `accel-train export/eval` can use a
        checkpoint on its own, wherever its folder has been moved."""
        if self.accelerator.is_main_process:
            self.spec.save(Path(output_dir))

    def save_checkpoint(self) -> Path:
        path = self.checkpointer.save(self.state)
        self.logger.info(f"saved checkpoint {path}")
        return path

    def _request_stop(self, signum, frame):
        # The first signal asks for a checkpoint at the next optimizer step; a second Ctrl-C
        # means "now", at the cost of what was trained since the last checkpoint.
        if signum == signal.SIGINT and self._stop_signal is not None:
            raise KeyboardInterrupt
        self._stop_signal = signum

    def _stop_requested_anywhere(self) -> bool:
        """All ranks agree to stop at the same optimizer step (one tiny all-reduce per step)."""
        local = 0 if self._stop_signal is None else self._stop_signal
        if self._control_group is None:  # one process: nobody to agree with
            return local != 0
        flag = torch.tensor([local], dtype=torch.int32)  # on the CPU: see _control_group
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control_group)
        return bool(flag.item())

    def _stop_for_signal(self) -> int:
        path = self.save_checkpoint()
        self.print(f"stopped by a signal at step {self.state.step}: saved {path}; run the same "
                   f"command with --resume auto to continue")
        return 143  # 128 + SIGTERM: schedulers read it as "terminated", not "finished"

    def save_model(self):
        """model.safetensors + model_config.json: enough to rebuild the model for inference."""
        acc = self.accelerator
        acc.wait_for_everyone()
        state_dict = acc.get_state_dict(self.model)
        if acc.is_main_process:
            tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
            save_file(tensors, str(self.output_dir / WEIGHTS_FILE))
            self.spec.save(self.output_dir)
            self.print(f"saved {self.output_dir / WEIGHTS_FILE}")
        acc.wait_for_everyone()

    def _maybe_plot(self):
        """PNG curves in <run>/plots (main process).  Drawing comes after the model is saved and
        a failure only warns: a finished run must not end as failed over a figure."""
        if not (self.config.plots and self.accelerator.is_main_process):
            return
        try:
            written = write_plots(self.output_dir)
        except Exception as err:  # matplotlib/font trouble; the traceback goes to the rank log
            self.logger.exception("drawing the plots failed")
            self.warn(f"could not draw the plots ({type(err).__name__}: {err}); try again with "
                      f"accel-train plot {self.output_dir}")
            return
        if written:
            self.print(f"plots: {', '.join(str(path) for path in written)}")

    def close(self):
        self.accelerator.end_training()


class _Window:
    """Accumulates a few logged steps' worth of losses, correct answers, samples and data-wait
    time (tensors stay on the device: no sync per step)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.losses: list[torch.Tensor] = []
        self.correct: list[torch.Tensor] = []
        self.samples = 0  # all processes together
        self.data_wait = 0.0

    def add(self, loss: torch.Tensor, num_correct: torch.Tensor, samples: int):
        self.losses.append(loss.float())
        self.correct.append(num_correct)
        self.samples += samples


def run_training(config: TrainConfig) -> int:
    """Parse-build-train-close: the whole `train` command."""
    env = distributed.setup(config)
    trainer = None
    try:
        trainer = Trainer(config, env)
        return trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        distributed.teardown()

