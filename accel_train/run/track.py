"""What a run tells the user and records: metrics.jsonl, the progress display, per-rank logs.

Only the main process writes shared files and prints; every process keeps its own log file in
`<output-dir>/logs/rank<R>.log`, so a failure on rank 3 can be read after the fact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from accel_train.base.errors import UsageError
from accel_train.base.readers import read_json_lines
from accel_train.base.wording import in_callers_words
from accel_train.train.divergence import NonFiniteLosses, loss_scale, \
    stop_if_diverged, stop_if_scale_collapsed
from accel_train.train.optim import scheduled_learning_rate
# metrics.jsonl record -> tracker scalar names; the prefix groups charts in TensorBoard and wandb.
_TRACKED = {"train": {"loss": "train/loss", "top1": "train/top1", "lr": "train/lr",
                      "img_per_s": "train/img_per_s", "data_wait": "train/data_wait",
                      "loss_scale": "train/loss_scale"},
            "epoch": {"eval_loss": "eval/loss", "eval_top1": "eval/top1",
                      "eval_top5": "eval/top5", "eval_mean_class_top1": "eval/mean_class_top1",
                      "epoch_time": "train/epoch_seconds",
                      "eval_ema_loss": "eval_ema/loss", "eval_ema_top1": "eval_ema/top1",
                      "eval_ema_top5": "eval_ema/top5",
                      "eval_ema_mean_class_top1": "eval_ema/mean_class_top1"}}


class MetricsLog:
    """Append-only JSON lines, one per logged step and per epoch (main process only)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = Path(path), enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                  for k, v in record.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume: drop what was logged after the checkpoint's step, so the log reads as if
        the run had never stopped (the steps after it are about to be redone)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path, warn=_log_only)
                if record.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
        os.replace(tmp, self.path)


def tracker_scalars(record: dict) -> dict[str, float]:
    """The scalars of a metrics.jsonl record under their tracker names ("train/loss", ...)."""
    names = _TRACKED.get(record.get("type"), {})
    return {names[k]: v for k, v in record.items() if k in names and isinstance(v, (int, float))}


def check_trackers(names: list[str]) -> None:
    """--report-to names that accelerate knows and that are installed, or a one-line error.
    (Accelerate itself skips an uninstalled tracker with only a debug message.)"""
    if not names:
        return
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    available = sorted(str(t) for t in get_available_trackers())
    for name in names:
        if name == "all":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise UsageError(f"--report-to {name}: not a tracker accelerate knows; choose from "
                             f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))} (installed here: "
                             f"{', '.join(available) or 'none'})")
        if name not in available:
            raise UsageError(f"--report-to {name}: its package is not installed; pip install "
                             f"{name}, or drop it (metrics.jsonl is always written)")


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The records of a metrics.jsonl (readers.py): a last line cut short (a run killed while
    writing it) is left out with a warning; any other line that is not a JSON record is one
    line (UsageError) naming the file and the line."""
    return read_json_lines(Path(path), "metrics", warn or _print_warning, "a metrics record")


def _print_warning(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def _log_only(text: str) -> None:
    logging.getLogger("accel_train").info(text)


def rank_logger(log_dir: Path, rank: int) -> logging.Logger:
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"accel_train.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    close_handlers(logger)  # an earlier run's in this process, had it not closed them
    handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def close_handlers(logger: logging.Logger) -> None:
    """Removes `logger`'s handlers and closes them: removing alone leaves a file open until
    the collector gets to it."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


def _format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A tqdm bar on a terminal, plain periodic lines otherwise (CI logs, files, launchers)."""

    def __init__(self, enabled: bool, mode: str):
        self.enabled = enabled
        self.use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.total: Optional[int] = None
        self.start_step = 0
        self.started = time.perf_counter()
        self.bar: Optional[tqdm] = None

    def start(self, total_steps: Optional[int], initial_step: int) -> None:
        """Training starts at `initial_step`; `total_steps` None: not known yet (--time-budget,
        until `set_total`)."""
        self.total, self.start_step = total_steps, initial_step
        self.started = time.perf_counter()
        if self.enabled and self.use_bar:
            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step",
                            dynamic_ncols=True, leave=True)

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        shown = {"loss": f"{metrics['loss']:.4f}", "train-top1": f"{metrics['top1']:.0%}",
                 "lr": f"{metrics['lr']:.3g}", "img/s": f"{metrics['img_per_s']:.0f}"}
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(shown, refresh=True)
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.total - step) if done and self.total else float("nan")
        eta_text = _format_eta(eta) if math.isfinite(eta) else "?"
        print(f"step {step}/{self.total or '?'} epoch {metrics['epoch']} loss {shown['loss']} "
              f"train-top1 {shown['train-top1']} lr {shown['lr']} img/s {shown['img/s']} "
              f"data-wait {metrics['data_wait']:.1%} eta {eta_text}", flush=True)

    def set_total(self, total_steps: int) -> None:
        self.total = total_steps
        if self.bar is not None:
            self.bar.total = total_steps
            self.bar.refresh()

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        text = in_callers_words(text)
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LogWindow:
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


class TrainLog:
    """The `train` records: every --log-every optimizer steps (and at the end of an epoch none
    of whose steps fell on it), the loss and top-1 of the steps since the last one over all
    ranks (a loss that is not finite checks the weights, and stops the run where it persists:
    divergence.py), the learning rate, images per second
    and the share of that time spent waiting for input; into metrics.jsonl, the trackers, the
    progress display and `on_record` (the callbacks)."""

    def __init__(self, accelerator, state, every: int, metrics: MetricsLog, progress: Progress,
                 wait_clock, model: torch.nn.Module, optimizer, bad_images,
                 on_record: Callable[[dict], None]):
        """`state`: the run's TrainerState (its step, epoch and samples seen); `model`: the bare
        model, whose weights name the first non-finite parameter."""
        self.accelerator, self.state, self.every = accelerator, state, every
        self.metrics, self.progress, self.wait_clock = metrics, progress, wait_clock
        self.model, self.optimizer, self.bad_images = model, optimizer, bad_images
        self.on_record = on_record
        self.window = LogWindow()
        self.non_finite = NonFiniteLosses()
        self.unlogged: list[torch.Tensor] = []
        self.epoch_began_at = 0

    def start_epoch(self) -> None:
        # the last epoch's steps after its last record go unlogged, but they are batches in a
        # row all the same: their losses are counted with the next record's
        self.unlogged += self.window.losses
        self.window = LogWindow()
        self.wait_clock.take()  # the last epoch's steps after its last logged one
        # the epoch's first step, also where a resume starts inside it
        self.epoch_began_at = self.state.step - \
            self.state.samples_in_epoch // self.state.global_batch

    def end_epoch(self) -> None:
        """An epoch none of whose steps falls on --log-every (a run shorter than it, epochs of
        fewer steps) still gets one record, at its last step: else such a run records no loss,
        learning rate or pace, and plots accuracy alone.  A function of the steps, so a resumed
        run writes it where the run it continues would have."""
        if self.window.losses and \
                self.state.step // self.every == self.epoch_began_at // self.every:
            self._write(self.window)
            self.window = LogWindow()

    def add(self, loss: torch.Tensor, num_correct: torch.Tensor, samples: int) -> None:
        self.window.add(loss, num_correct, samples)

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            self._write(self.window)
            self.window = LogWindow()

    def stop_if_nothing_learned(self, unsaved: str) -> None:
        """At the end of training (every rank): stop before `unsaved` is written when no batch
        of this start had a finite loss, counting the batches since the last record too."""
        if self.unlogged or self.window.losses:
            self.non_finite.add(self._finite_per_batch(self.unlogged + self.window.losses))
            self.unlogged, self.window = [], LogWindow()
        self.non_finite.stop_if_none_finite(self.state.step, unsaved)

    def _finite_per_batch(self, losses: list[torch.Tensor]) -> list[bool]:
        """Whether each batch's loss was finite on every rank (one collective)."""
        acc = self.accelerator
        bad = (~torch.isfinite(torch.stack(losses))).float().to(acc.device)
        return (acc.reduce(bad, "sum") == 0).tolist()

    def _write(self, window: LogWindow) -> None:
        acc, state = self.accelerator, self.state
        loss = acc.reduce(torch.stack(window.losses).mean().to(acc.device), "mean").item()
        batches, self.unlogged = self.unlogged + window.losses, []
        if math.isfinite(loss):  # then so were the window's batches, the last ones in the row
            self.non_finite.add([True] * len(batches))
        else:  # (the reduced loss: every rank takes this branch)
            stop_if_diverged(self.model, state.step)
            self.non_finite.add(self._finite_per_batch(batches))
            self.non_finite.stop_if_too_many(state.step)
        scale = loss_scale(acc.scaler)  # the same on every rank
        stop_if_scale_collapsed(scale, state.step)
        correct = acc.reduce(torch.stack(window.correct).sum().to(acc.device), "sum").item()
        elapsed = time.perf_counter() - window.started
        window.data_wait = self.wait_clock.take()  # after the .item()s: no sync of its own
        record = {"type": "train", "step": state.step, "epoch": state.epoch + 1,
                  "loss": round(loss, 6), "top1": round(correct / window.samples, 4),
                  "lr": scheduled_learning_rate(self.optimizer),
                  "img_per_s": round(window.samples / elapsed, 2),
                  "data_wait": round(window.data_wait / elapsed, 4),
                  "samples_seen": state.samples_seen}
        if scale is not None:
            record["loss_scale"] = scale
        self.bad_images.collect()
        self.metrics.write(record)
        acc.log(tracker_scalars(record), step=state.step)
        self.progress.update(state.step, record)
        self.on_record(record)
