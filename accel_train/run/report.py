"""What a run says: one voice for all ranks on the console, one log file per rank, the resolved
facts recorded in config.yaml, and the start-up summary printed from them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from accel_train.base.ranks import print_once
from accel_train.run.rundir import PLOTS_DIR, TRACKERS_DIR, RunPaths
from accel_train.run.track import close_handlers, rank_logger


class Reporter:
    """Prints once in total (global main process) and logs on every rank to
    <run>/logs/rank<R>.log.  The log opens only once the start is known good (`open_log`):
    a failed start writes no file.  What was said before that goes into the log when it opens."""

    def __init__(self, earlier: tuple[str, ...] = ()):
        self._logger: Optional[logging.Logger] = None
        self._before_log: list[tuple[int, str]] = [
            (logging.WARNING if text.startswith("warning: ") else logging.INFO,
             text.removeprefix("warning: ")) for text in earlier]

    def open_log(self, log_dir: Path, rank: int, first_line: str) -> None:
        self._logger = rank_logger(log_dir, rank)
        self._logger.info(first_line)
        for level, text in self._before_log:
            self._logger.log(level, text)
        self._before_log.clear()

    def close_log(self) -> None:
        """Closes this rank's log at the run's end: a program may train many runs in one
        process, and each run's file is closed with it, not held open until the next replaces
        it.  What is said after that goes to the console only."""
        if self._logger is not None:
            close_handlers(self._logger)
            self._logger = None

    def _log(self, level: int, text: str) -> None:
        if self._logger is None:
            self._before_log.append((level, text))
        else:
            self._logger.log(level, text)

    def say(self, text: str) -> None:
        self._log(logging.INFO, text)
        print_once(text)

    def warn(self, text: str) -> None:
        self._log(logging.WARNING, text)
        print_once(f"warning: {text}")

    def log(self, text: str) -> None:
        """Into this rank's log only."""
        self._log(logging.INFO, text)

    def log_exception(self, text: str) -> None:
        if self._logger is not None:
            self._logger.exception(text)


# what a sample limit (--max-train-samples, --max-eval-samples) kept, by --sample-subset
LIMITS_KEPT = {"random": "limits kept a seeded draw: --sample-subset random",
               "first": "limits kept the first ones: --sample-subset first"}


def summary(facts: dict, data_description: str, accumulation_steps: int, backend: Optional[str],
            records: str) -> str:
    """The start-up summary: what will really run, from the resolved facts."""
    model = facts["model"]
    world = facts["world_size"]
    per_process = facts["global_batch"] // world // accumulation_steps
    backend_text = f", {backend}" if world > 1 and backend else ""
    if facts["device"].startswith("cpu") and facts.get("cpu_threads"):  # what ranks share
        threads = facts["cpu_threads"]
        backend_text += f", {threads} thread{'' if threads == 1 else 's'}" + \
            (" each" if world > 1 else "")
    return (
        f"accel_train: {model['model_name']} ({facts['trainable_parameters']:,} trainable "
        f"parameters) on {data_description}\n"
        f"  device {facts['device']} x {world} process(es){backend_text}; precision "
        f"{facts['precision_used']}, {'channels_last' if facts['channels_last'] else 'NCHW'} "
        f"({facts['speed_choice']}); sync-bn {'on' if facts['sync_bn'] else 'off'}\n"
        + (f"  cuda: {facts['cuda_math']}\n" if facts.get("cuda_math") else "")
        + (f"  host memory: {facts['host_memory']}\n" if facts.get("host_memory") else "")
        + (f"  network: {facts['network_choice']}\n" if facts.get("network_choice") else "")
        + (f"  weights: {facts['pretrained']}\n" if facts.get("pretrained") else "")
        + (f"  init: {facts['whitened_stem']}\n" if facts.get("whitened_stem") else "")
        + (f"  loss: {facts['class_weights']['summary']}\n" if facts.get("class_weights")
           else "") +
        f"  data: {facts['train_samples']} train / {facts['eval_samples']} validation"
        + (f" / {facts['test_samples']} test" if facts.get("test_samples") else "") + " images"
        + (f" ({LIMITS_KEPT[facts['sample_subset']]})" if facts.get("sample_subset") else "")
        + ", "
        f"{len(model['class_names'])} classes, {model['image_size']}px, "
        + (f"training photos decoded once on the device{_held_in(facts)}, "
           if facts.get("photos_held") else
           f"{'decoded in memory' if facts['data_in_memory'] else 'decoded per step'}, ")
        + ("resized and cropped on the device, " if facts.get("placed_on_device") else "") +
        f"{facts['num_workers']} loader worker(s)\n"
        + (f"  labels: {facts['labels']}\n" if facts.get("labels") else "")
        # which training loader build_loaders chose, and why (--data-on-device)
        + (f"  train batches: {facts['train_loader']}\n" if facts.get("train_loader") else "")
        + (f"  held-out batches: {facts['held_out_batches']}\n"
           if facts.get("held_out_batches") else "")
        + (f"  JPEGs decoded {facts['jpeg_decoding']}\n" if facts.get("jpeg_decoding") else "")
        + f"  global batch {facts['global_batch']} = {per_process} per process x {world} "
        f"process(es) x {accumulation_steps} accumulation step(s); "
        f"{facts['steps_per_epoch']} steps/epoch, "
        f"{_length_words(facts['total_steps'], facts.get('max_steps'))}\n"
        f"  output: {facts['output_dir']} (checkpoints in {facts['checkpoint_dir']}"
        + _cadence_words(facts.get("checkpoint_minutes")) + ")\n"
        f"  records: {records}" + _slurm_line(facts.get("launcher", {}).get("slurm")))


def _cadence_words(minutes: Optional[float]) -> str:
    """--checkpoint-minutes, where set: which epoch ends save."""
    if not minutes:
        return ""
    return f"; at an epoch end once {minutes:g} min have passed since the last, and at the end"


def _held_in(facts: dict) -> str:
    """How long decoding the held training photos took at the start, where known."""
    seconds = facts.get("photos_held_seconds")
    return f" in {seconds:.1f} s" if seconds is not None else ""


def _length_words(total_steps: Optional[int], max_steps: Optional[int]) -> str:
    """The run's length, or how a --time-budget run fits it after a few steps (within
    --max-steps where given: the budget then only shortens the run)."""
    if total_steps:
        return f"{total_steps} steps in all"
    cap = f", at most {max_steps} (--max-steps)" if max_steps else ""
    return f"fitted to --time-budget after a few steps in all{cap}"


def _slurm_line(slurm: Optional[dict]) -> str:
    """The SLURM job and node, when the run is one (scripts/slurm/train.sbatch)."""
    if not slurm:
        return ""
    return (f"\n  slurm: job {slurm['job_id']} on {slurm['node']} (node {slurm['node_id']} of "
            f"{slurm['num_nodes']}), requeued {slurm['restart_count']} time(s)")


def records_text(paths: RunPaths, report_to: list[str], plots: bool) -> str:
    """What the run records besides checkpoints, and where."""
    parts = [paths.metrics.name]
    if report_to:
        parts.append(f"{' + '.join(report_to)} (files in {TRACKERS_DIR}/)")
    if plots:
        parts.append(f"PNG curves at the end in {PLOTS_DIR}/")
    return ", ".join(parts)
