"""Two test-only hooks, each off unless its environment variable is set.

They exist so that the fault-tolerance tests can be real (a real SIGKILL in the middle of a
checkpoint write; a count of the samples each rank really trained on) without timing races.

* ACCEL_TRAIN_FAULT_STALL_SAVE=STEP: in the first launch attempt (TORCHELASTIC_RESTART_COUNT unset
  or 0), the save of checkpoint STEP stalls after every file but the manifest is written, and says
  so in the log ("fault injection: stalling ..."), so a test can kill the process mid-save.
  Restarted workers never stall: they must get past the same step to finish.
* ACCEL_TRAIN_SAMPLE_LOG=1: every rank appends the sampler keys (epoch * N + index) of each
  micro-batch it trains on to <output-dir>/logs/samples-rank<R>.jsonl; a resume drops the records
  of steps after the checkpoint (they are about to be redone), as it does for metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils.data import Dataset

STALL_ENV = "ACCEL_TRAIN_FAULT_STALL_SAVE"
SAMPLE_LOG_ENV = "ACCEL_TRAIN_SAMPLE_LOG"
STALL_SECONDS = 300  # long enough for any test to kill us; short enough not to hang CI forever


def maybe_stall_save(step: int, say: Callable[[str], None]) -> None:
    wanted = os.environ.get(STALL_ENV)
    if not wanted or int(wanted) != step or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        return
    say(f"fault injection: stalling the save of step {step} before its manifest ({STALL_ENV})")
    deadline = time.monotonic() + STALL_SECONDS
    while time.monotonic() < deadline:  # short sleeps: a signal handler still runs promptly
        time.sleep(0.05)


def sample_log_enabled() -> bool:
    return os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0")


class WithSampleKeys(Dataset):
    """Wraps the training dataset so each item also carries its sampler key."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        return (*self.dataset[key], int(key))

    def __getitems__(self, keys: list[int]):
        # Fetch the batch the way the loader would without this wrapper (a dataset may build a
        # whole batch at once), then hand the default collate plain (image, label, key) triples.
        fetch = getattr(self.dataset, "__getitems__", None)
        samples = fetch(keys) if fetch is not None else [self.dataset[key] for key in keys]
        return [(*sample, int(key)) for sample, key in zip(samples, keys)]


class SampleLog:
    """Per-rank JSON lines {"step": optimizer step the micro-batch belongs to, "keys": [...]}."""

    def __init__(self, log_dir: Path, rank: int):
        self.path = Path(log_dir) / f"samples-rank{rank}.jsonl"

    def record(self, step: int, keys: torch.Tensor) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "keys": keys.tolist()}) + "\n")

    @staticmethod
    def truncate_after(log_dir: Path, step: int) -> None:
        """Main process, on resume: forget micro-batches of steps after the checkpoint."""
        for path in Path(log_dir).glob("samples-rank*.jsonl"):
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))


def read_sample_keys(log_dir: Path) -> list[int]:
    """Every key trained on, over all ranks and restarts (for tests)."""
    keys: list[int] = []
    for path in sorted(Path(log_dir).glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                keys.extend(json.loads(line)["keys"])
    return keys


def maybe_sample_log(log_dir: Path, rank: int) -> Optional[SampleLog]:
    return SampleLog(log_dir, rank) if sample_log_enabled() else None
