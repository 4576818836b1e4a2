"""Callbacks: a program's own code at fixed points of a training run, in the style of Keras
callbacks and Hugging Face's TrainerCallback.  Subclass `Callback`, override the methods you
need (each does nothing here), and hand instances to the trainer
(`Trainer.from_config(config, callbacks=[...])`, `trainer.run_training(config, callbacks)`).
The command line has none.

Every method is called on every process, at the same point of the run, with the `Trainer`: its
`state` (step, epoch, samples_in_epoch, best_top1, ...), `config`, `model` (as prepared),
`bare_model()` (without DDP's and torch.compile's wrappers) and `accelerator`
(`accelerator.is_main_process`: the one process that should write a file all of them share).
They run inside the loop: the time a callback takes, the run takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


class Callback:
    def on_train_begin(self, trainer) -> None:
        """Before the first step of this start.  `trainer.state.step` is where it starts: 0, or
        on resume the checkpoint's step (`trainer.plan.resume_from` names it); whatever was
        recorded of later steps is void, since they are about to be trained again.  Every
        process has returned from it before any process trains."""

    def on_batch_start(self, trainer, batch) -> None:
        """Before each micro-batch's forward pass.  `batch.images`, `batch.labels`, and
        `batch.keys`: each sample's place in the run (epoch * training images + index).  The
        micro-batch belongs to optimizer step `trainer.state.step + 1`."""

    def on_step_end(self, trainer, step: int) -> None:
        """After optimizer step `step` and what follows it (the averages, the time budget's
        fit, the log record); before the run checks for a stop signal and maybe checkpoints."""

    def on_log(self, trainer, record: dict) -> None:
        """Every --log-every optimizer steps: the `train` record written to metrics.jsonl (loss
        and top1 over all processes, lr, img_per_s, data_wait, step, epoch)."""

    def on_evaluate(self, trainer, metrics: dict) -> None:
        """After an epoch end's evaluation on the held-out split: eval_loss, eval_top1,
        eval_top5, eval_count, and with --model-ema eval_ema_loss, eval_ema_top1,
        eval_ema_top5."""

    def on_checkpoint(self, trainer, path: Path) -> None:
        """After a checkpoint is complete (its manifest written, the folder in place at `path`,
        older ones pruned)."""

    def on_train_end(self, trainer) -> None:
        """After a run that trained to its end has saved its final model (not after a stop
        signal or a stall)."""


class CallbackList:
    """The trainer's callbacks, each called in the order given."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"a callback must be an accel_train.callbacks.Callback, not "
                                f"{type(callback).__name__}")

    def __iter__(self):
        return iter(self.callbacks)

    @property
    def watch_checkpoints(self) -> bool:
        """Whether a callback has an on_checkpoint of its own (it is then called with the
        checkpoint complete, which the trainer otherwise completes while training goes on)."""
        return any(type(callback).on_checkpoint is not Callback.on_checkpoint
                   for callback in self.callbacks)

    def on_train_begin(self, trainer) -> None:
        for callback in self.callbacks:
            callback.on_train_begin(trainer)

    def on_batch_start(self, trainer, batch) -> None:
        for callback in self.callbacks:
            callback.on_batch_start(trainer, batch)

    def on_step_end(self, trainer, step: int) -> None:
        for callback in self.callbacks:
            callback.on_step_end(trainer, step)

    def on_log(self, trainer, record: dict) -> None:
        for callback in self.callbacks:
            callback.on_log(trainer, record)

    def on_evaluate(self, trainer, metrics: dict) -> None:
        for callback in self.callbacks:
            callback.on_evaluate(trainer, metrics)

    def on_checkpoint(self, trainer, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(trainer, path)

    def on_train_end(self, trainer) -> None:
        for callback in self.callbacks:
            callback.on_train_end(trainer)
