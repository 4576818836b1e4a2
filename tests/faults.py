"""Helpers for the fault-tolerance tests: start real runs under real launchers, wait for what
they write, kill exactly the processes we started, compare what they produced.

Nothing here sleeps a fixed time to "let things happen": every wait polls for a file or a log
line, with a generous deadline (the machine is slow and shared).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import psutil
import torch
from safetensors.torch import load_file

from accel_train.base.errors import STACKS_SIGNAL
from conftest import CONFIGS, REPO, TINY_TRAIN, free_port, test_env
from fault_entry import (POISON_ENV, SAMPLE_LOG_ENV, STALL_ENV,  # noqa: F401 (re-exported)
                         read_sample_keys)

# 256 synthetic images, 2 epochs.  Global batch 32 = 16 x 2 processes (8 steps/epoch) or
# 16 x 1 process x 2 accumulation; checkpoints every 3 steps and at each epoch end.
FAULT_TRAIN = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--epochs", "2",
               "--checkpoint-every", "3", "--log-every", "2", "--keep-checkpoints", "3"]
DEADLINE = 240.0
# The CLI with the faults of fault_entry.py installed through the trainer's seams (when its
# variables are set; otherwise exactly `python -m accel_train`).
ENTRY = "tests.fault_entry"
LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
# What torch names a loader worker process (its comm): they are children of the run's fork
# server, with its command line, not the training process's.
LOADER_WORKER_NAME = "pt_data_worker"


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", ENTRY, *args]


def torchrun_cmd(*args: str, nproc: int = 2, max_restarts: int = 0,
                 port: Optional[int] = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", "--master-addr", "127.0.0.1",
            "--master-port", str(port or free_port()), "-m", ENTRY, *args]


def accelerate_cmd(*args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
            "--max_restarts", str(max_restarts), "--monitor_interval", "0.5",
            "-m", ENTRY, *args]


class Run:
    """A launched command whose output goes to a file; killed (with its children) on close."""

    def __init__(self, cmd: list[str], log: Path, **env: str):
        self.cmd, self.log = cmd, Path(log)
        self.handle = self.log.open("w")
        # Own session: a signal we send to the launcher reaches only what we started.
        self.proc = subprocess.Popen(cmd, env=test_env(**env), cwd=REPO,
                                     stdin=subprocess.DEVNULL, stdout=self.handle,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.ask_for_stacks()  # 8 loader workers and 2 ranks: about 25 kB of stacks
            self.close()
            raise AssertionError(f"{' '.join(self.cmd)} did not finish in {timeout}s (the "
                                 f"stacks of its processes follow its output)\n"
                                 f"{self.output[-60000:]}") from None

    def ask_for_stacks(self, seconds: float = 1.0) -> None:
        """Every training process and loader worker under this run writes its Python stacks
        to the log (the CLI's SIGUSR1 handler, errors.stacks_on_request): a run that
        hangs in CI says where.  Launchers are left alone (SIGUSR1 would end them)."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            try:
                cmdline = " ".join(process.cmdline())
                trainer = ENTRY in cmdline and not any(word in cmdline for word in LAUNCHERS)
                if trainer or process.name() == LOADER_WORKER_NAME:
                    process.send_signal(STACKS_SIGNAL)
                    time.sleep(seconds)  # one at a time: their lines share the log
            except psutil.Error:
                pass

    def check(self, expected: int = 0, timeout: float = DEADLINE) -> str:
        code = self.wait(timeout)
        assert code == expected, f"exit {code}, expected {expected}\n{self.output[-6000:]}"
        return self.output

    def workers(self) -> dict[int, psutil.Process]:
        """Training processes started by this launcher, by global rank."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                environ, cmdline = child.environ(), child.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "RANK" in environ and ENTRY in cmdline:
                found[int(environ["RANK"])] = child
        return found

    def kill_all(self) -> None:
        """SIGKILL the launcher and every process under it, as when a machine dies.  Found
        through psutil from our own launcher's pid: torchrun starts each worker in a session of
        its own, so a process-group kill would miss them."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for process in [psutil.Process(self.proc.pid), *tree] if self.proc.poll() is None \
                else tree:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        psutil.wait_procs(tree, timeout=30)

    def close(self) -> None:
        self.kill_all()
        self.handle.close()


def wait_until(condition, what: str, run: Optional[Run] = None, timeout: float = DEADLINE):
    """Poll `condition()` until it is truthy; fail early if `run` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            value = condition()
            if value:
                return value
            raise AssertionError(f"exited {run.proc.returncode} before {what}\n"
                                 f"{run.output[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" +
                         (f"\n{run.output[-4000:]}" if run else ""))


def log_has(path: Path, text: str):
    return lambda: path.is_file() and text in path.read_text(errors="replace")


def wait_for_stall(run: Run, step: int) -> None:
    """Wait until rank 0 is stalled inside the save of `step` (fault_entry's STALL_ENV)."""
    wait_until(lambda: f"stalling the save of step {step} " in run.output,
               f"the stalled save of step {step}", run)


def kill_worker(run: Run, rank: int) -> int:
    """SIGKILL one worker, as the kernel's OOM killer or a dying machine would."""
    workers = wait_until(lambda: run.workers().get(rank), f"worker rank {rank}", run)
    os.kill(workers.pid, signal.SIGKILL)
    return workers.pid


def checkpoint_steps(output_dir: Path) -> list[int]:
    root = Path(output_dir) / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*")) if root.is_dir() else []


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / "model.safetensors"))


def max_weight_difference(a_dir: Path, b_dir: Path) -> float:
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_so_far(output_dir: Path) -> list[dict]:
    """metrics.jsonl's records while its run may still write it: none before it exists, and
    without a last line that has no newline yet.  A record is one write(), but the kernel
    shows a write that crosses a page boundary one page at a time, so a reader polling the
    file can see a record's first part alone."""
    path = Path(output_dir) / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()
            if line.strip()]


def assert_metrics_continuous(output_dir: Path, total_steps: int, log_every: int = 2,
                              epochs: int = 2) -> list[dict]:
    """metrics.jsonl reads as one run: each logged step and each epoch exactly once, in order."""
    records = metrics(output_dir)
    train_steps = [r["step"] for r in records if r["type"] == "train"]
    assert train_steps == list(range(log_every, total_steps + 1, log_every)), train_steps
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == list(range(1, epochs + 1))
    return records


def assert_each_sample_once_per_epoch(output_dir: Path, num_samples: int = 256,
                                      global_batch: int = 32, epochs: int = 2) -> None:
    """From the sample log (fault_entry's SAMPLE_LOG_ENV): every rank's micro-batches together
    use each sample of each epoch exactly once, and exactly the samples the epoch's order holds."""
    from accel_train.data.loaders import EpochSampler

    keys = read_sample_keys(Path(output_dir) / "logs")
    counts = Counter(keys)
    repeated = {k: n for k, n in counts.items() if n > 1}
    assert not repeated, f"samples used more than once: {sorted(repeated)[:10]}"
    sampler = EpochSampler(num_samples, global_batch, seed=0)
    expected = set()
    for epoch in range(epochs):
        expected |= set((sampler.order(epoch) + epoch * num_samples).tolist())
    missing, extra = expected - set(keys), set(keys) - expected
    assert not missing and not extra, f"missing {sorted(missing)[:10]}, extra {sorted(extra)[:10]}"


def stopped_at(text: str) -> int:
    """The step a run's "stopped by a signal at step N" line names."""
    return int(text.split("stopped by a signal at step ")[1].split(":")[0])


def checkpoint(out: Path, step: int) -> dict:
    """The trainer state of <out>/checkpoints/step_<step>, after checking its manifest."""
    from accel_train.run.checkpoint import verify
    path = out / "checkpoints" / f"step_{step:08d}"
    assert verify(path) is None, f"{path}: {verify(path)}"
    return json.loads((path / "trainer_state.json").read_text())


def resolved(out: Path) -> dict:
    """What a run resolved (config.yaml's `resolved` section)."""
    import yaml
    return yaml.safe_load((out / "config.yaml").read_text())["resolved"]
