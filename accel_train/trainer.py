"""The training loop on Accelerate: prepare, accumulate, autocast, evaluate with
gather_for_metrics, checkpoint, resume.

Every rank-sensitive act goes through the Accelerator: printing and writing shared files happen on
the main process, `wait_for_everyone` precedes reading what another rank wrote.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list
from safetensors.torch import save_file

from . import distributed
from .checkpoint import Checkpointer, TrainerState
from .config import TrainConfig
from .data import (EpochSampler, EvalImages, TrainImages, dataset_mean_std, default_num_workers,
                   make_loader)
from .errors import UsageError
from .model import (WEIGHTS_FILE, ModelSpec, check_image_size, create_model, freeze_backbone,
                    pretrained_normalization, set_train_mode)
from .optim import build_optimizer, build_scheduler
from .rundir import prepare_output_dir, write_run_config
from .sources import ArraySource, load_data
from .syncbn import convert_sync_batchnorm, num_batchnorm_layers
from .track import METRICS_FILE, MetricsLog, Progress, rank_logger
from .transforms import ImageTransform


def resolve_precision(requested: str, cuda: bool) -> tuple[str, Optional[str]]:
    """The precision that will really run, and a warning when it is not the one asked for."""
    if requested == "fp16" and not cuda:
        return "no", ("--mixed-precision fp16 needs a CUDA device; this run trains in fp32 "
                      "(use --mixed-precision bf16 for reduced precision on CPU)")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        return "no", "this GPU has no bf16 support; this run trains in fp32"
    return requested, None


def _agree(accelerator: Accelerator, compute):
    """Run `compute` on the main process and give its result (or its UsageError) to all ranks,
    so that decisions about shared files are made once and never diverge across ranks."""
    result: list = [None]
    if accelerator.is_main_process:
        try:
            result[0] = ("ok", compute())
        except UsageError as err:
            result[0] = ("error", str(err))
    if accelerator.num_processes > 1:
        broadcast_object_list(result, from_process=0)
    kind, value = result[0]
    if kind == "error":
        raise UsageError(value)
    return value


class Trainer:
    def __init__(self, config: TrainConfig, env: distributed.LauncherEnv):
        self.config = config
        cuda = torch.cuda.is_available()
        self.precision, precision_warning = resolve_precision(config.mixed_precision, cuda)
        ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=False)
        self.accelerator = acc = Accelerator(
            cpu=not cuda, mixed_precision=self.precision,
            gradient_accumulation_steps=config.accumulation_steps,
            step_scheduler_with_optimizer=False,  # we step it once per optimizer step (optim.py)
            log_with=config.report_to or None, kwargs_handlers=[ddp_kwargs])
        if acc.num_processes != env.world_size:
            raise RuntimeError(f"Accelerate sees {acc.num_processes} processes but the launcher "
                               f"started {env.world_size}: the process group was not shared")

        resume = config.resume
        if resume is None and distributed.is_elastic_restart():
            resume = "auto"  # a restarted worker continues from the newest checkpoint
        self.output_dir = Path(_agree(acc, lambda: prepare_output_dir(config, resume, env)))
        self.checkpoint_dir = Path(config.checkpoint) if config.checkpoint else \
            self.output_dir / "checkpoints"
        self.logger = None  # created once the start is known good: a failed start writes nothing
        self.checkpointer = Checkpointer(acc, self.checkpoint_dir, config.keep_checkpoints,
                                         self.warn)

        with acc.main_process_first():  # datasets caches Arrow files: build them once
            self.data = load_data(config)
        self._build_model()
        self._build_loaders()
        self._build_optimization()
        self.model, self.optimizer, self.train_loader, self.eval_loader, self.scheduler = \
            acc.prepare(self.model, self.optimizer, self.train_loader, self.eval_loader,
                        self.scheduler)

        self.state = TrainerState(world_size=acc.num_processes, batch_size=config.batch_size,
                                  accumulation_steps=config.accumulation_steps, seed=config.seed)
        self.logger = rank_logger(self.output_dir / "logs", acc.process_index)
        self.checkpointer.clean_stale_temporaries()
        self.metrics = MetricsLog(self.output_dir / METRICS_FILE, acc.is_main_process)
        if resume is not None:
            self._maybe_resume(resume)
        if acc.is_main_process:
            write_run_config(self.output_dir, config, self._resolved_facts())
        if config.report_to:
            acc.init_trackers("accel_train", config={k: v for k, v in config.to_dict().items()
                                                     if isinstance(v, (int, float, str, bool))})
        self._stop_signal: Optional[int] = None
        if precision_warning:
            self.warn(precision_warning)
        self._print_summary()

    # -- construction -------------------------------------------------------------------------
    def _build_model(self):
        config, data = self.config, self.data
        native = data.train.native_size if isinstance(data.train, ArraySource) else 224
        image_size = config.image_size or native
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
        self.train_loader = make_loader(TrainImages(self.data.train, train_tf, config.seed),
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

    def _maybe_resume(self, resume: str):
        path = _agree(self.accelerator, lambda: self.checkpointer.resolve(resume))
        if path is None:
            self.print("no valid checkpoint found: starting from scratch")
            return
        previous = self.checkpointer.load(Path(path))
        if previous.global_batch != self.global_batch:
            self._explain_batch_mismatch(previous)
        self.state.step, self.state.epoch = previous.step, previous.epoch
        self.state.samples_in_epoch = previous.samples_in_epoch
        self.state.samples_seen, self.state.best_top1 = previous.samples_seen, previous.best_top1
        # Accelerate counts micro-steps to know when to sync; a resume is always at an optimizer
        # step boundary, and the accumulation count may have changed with the world size.
        self.accelerator.step = 0
        self.metrics.truncate_after(previous.step)
        self.metrics.write({"type": "resume", "step": previous.step, "from": str(path),
                            "world_size": self.accelerator.num_processes,
                            "previous_world_size": previous.world_size})
        self.print(f"resumed from {path} at step {previous.step} (epoch {previous.epoch + 1}, "
                   f"{previous.samples_in_epoch} samples into it)")

    def _explain_batch_mismatch(self, previous: TrainerState):
        procs = self.accelerator.num_processes
        target = previous.global_batch
        per_proc = target // procs if target % procs == 0 else None
        options = []
        if per_proc is not None:
            for accum in range(1, per_proc + 1):
                if per_proc % accum == 0:
                    options.append(f"--batch-size {per_proc // accum} --accumulation_steps {accum}")
                if len(options) == 3:
                    break
        hint = ("; ".join(options) if options else
                f"a process count that divides {target}")
        raise UsageError(f"the checkpoint was trained with a global batch of {target} "
                         f"({previous.batch_size} x {previous.world_size} processes x "
                         f"{previous.accumulation_steps} accumulation) but this run has "
                         f"{self.global_batch}; with {procs} process(es) use {hint}")

    # -- reporting ----------------------------------------------------------------------------
    def print(self, text: str):
        if self.logger is not None:
            self.logger.info(text)
        self.accelerator.print(text, flush=True)

    def warn(self, text: str):
        if self.logger is not None:
            self.logger.warning(text)
        self.accelerator.print(f"warning: {text}", flush=True)

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
                "output_dir": str(self.output_dir), "checkpoint_dir": str(self.checkpoint_dir)}

    def _print_summary(self):
        facts, acc = self._resolved_facts(), self.accelerator
        backend = f", {torch.distributed.get_backend()}" if acc.num_processes > 1 else ""
        self.print(
            f"accel_train: {self.spec.model_name} on {self.data.description}\n"
            f"  device {facts['device']} x {acc.num_processes} process(es){backend}; precision "
            f"{facts['precision_used']}; sync-bn {'on' if self.sync_bn else 'off'}\n"
            f"  data: {facts['train_samples']} train / {facts['eval_samples']} held-out images, "
            f"{len(self.spec.class_names)} classes, {self.spec.image_size}px, "
            f"{'decoded in memory' if facts['data_in_memory'] else 'decoded per step'}, "
            f"{self.num_workers} loader worker(s)\n"
            f"  global batch {self.global_batch} = {self.config.batch_size} per process x "
            f"{acc.num_processes} x {self.config.accumulation_steps} accumulation; "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps in all\n"
            f"  output: {self.output_dir} (checkpoints in {self.checkpoint_dir})")

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
                images, labels = next(batches)
            except StopIteration:
                break
            window.data_wait += time.perf_counter() - wait_started
            with acc.accumulate(self.model):
                loss = self.train_step(images, labels)
            window.add(loss, per_micro_step)
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

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch: forward, backward, and (on the last micro-step) the update."""
        if self.config.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with self.accelerator.autocast():
            loss = self.loss_fn(self.model(images), labels)
        self.accelerator.backward(loss)
        if self.config.grad_clip and self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()  # Accelerate makes these no-ops until the accumulation completes
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _end_epoch(self, epoch_seconds: Optional[float]):
        state = self.state
        results = self.evaluate()
        state.best_top1 = max(results["top1"], state.best_top1 or 0.0)
        record = {"type": "epoch", "epoch": state.epoch + 1, "step": state.step,
                  **{f"eval_{k}": v for k, v in results.items() if k != "per_class"}}
        if epoch_seconds is not None:
            record["epoch_time"] = round(epoch_seconds, 3)
        self.metrics.write(record)
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                             step=state.step)
        timing = f" Time {epoch_seconds:.1f}s" if epoch_seconds is not None else ""
        self.progress.write(f"Epoch {state.epoch + 1}{timing}: eval loss {results['loss']:.4f} "
                            f"top1 {results['top1']:.2%} top5 {results['top5']:.2%} "
                            f"({results['count']} images)")
        state.epoch += 1
        state.samples_in_epoch = 0
        self.save_checkpoint()

    @torch.no_grad()
    def evaluate(self, loader=None) -> dict:
        """Loss, top-1, top-5 and per-class accuracy over the whole held-out split, exactly once
        per sample: per-sample values go through gather_for_metrics, which drops the samples the
        distributed sampler repeated to even out the last batch."""
        acc = self.accelerator
        loader = self.eval_loader if loader is None else loader
        # The bare module: no DDP buffer broadcast, so no collective inside forward.
        model = acc.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        parts: dict[str, list] = {"loss": [], "top1": [], "top5": [], "labels": [], "pred": []}
        for images, labels in loader:
            if self.config.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with acc.autocast():
                logits = model(images)
            k = min(5, logits.shape[1])
            topk = logits.float().topk(k, dim=1).indices
            values = (F.cross_entropy(logits.float(), labels, reduction="none"),
                      topk[:, 0] == labels, (topk == labels[:, None]).any(dim=1), labels, topk[:, 0])
            for key, value in zip(parts, acc.gather_for_metrics(values)):
                parts[key].append(value.cpu())
        model.train(was_training)
        merged = {k: torch.cat(v) for k, v in parts.items()}
        count = len(merged["labels"])
        num_classes = self.spec.num_classes
        per_class_total = torch.bincount(merged["labels"], minlength=num_classes)
        per_class_correct = torch.bincount(merged["labels"][merged["top1"]], minlength=num_classes)
        return {"loss": float(merged["loss"].mean()), "top1": float(merged["top1"].float().mean()),
                "top5": float(merged["top5"].float().mean()), "count": count,
                "per_class": {"correct": per_class_correct.tolist(),
                              "total": per_class_total.tolist()}}

    # -- logging, checkpoints, signals --------------------------------------------------------
    def _log_window(self, window: "_Window"):
        acc, state = self.accelerator, self.state
        loss = acc.reduce(torch.stack(window.losses).mean().to(acc.device), "mean").item()
        elapsed = time.perf_counter() - window.started
        record = {"type": "train", "step": state.step, "epoch": state.epoch + 1,
                  "loss": round(loss, 6), "lr": self.scheduler.get_last_lr()[0],
                  "img_per_s": round(window.samples / elapsed, 2),
                  "data_wait": round(window.data_wait / elapsed, 4),
                  "samples_seen": state.samples_seen}
        self.metrics.write(record)
        self.accelerator.log({k: v for k, v in record.items() if k not in ("type",)},
                             step=state.step)
        self.progress.update(state.step, record)

    def save_checkpoint(self) -> Path:
        path = self.checkpointer.save(self.state)
        self.logger.info(f"saved checkpoint {path}")
        return path

    def _request_stop(self, signum, frame):
        self._stop_signal = signum

    def _stop_requested_anywhere(self) -> bool:
        """All ranks agree to stop at the same optimizer step (one tiny all-reduce per step)."""
        local = 0 if self._stop_signal is None else self._stop_signal
        if self.accelerator.num_processes == 1:
            return local != 0
        flag = torch.tensor([local], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item())

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

    def close(self):
        self.accelerator.end_training()


class _Window:
    """Accumulates a few logged steps' worth of losses, samples and data-wait time."""

    def __init__(self):
        self.started = time.perf_counter()
        self.losses: list[torch.Tensor] = []
        self.samples = 0
        self.data_wait = 0.0

    def add(self, loss: torch.Tensor, samples: int):
        self.losses.append(loss.float())
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

