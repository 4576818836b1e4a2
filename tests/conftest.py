"""Shared helpers for the test suite.

Everything runs on CPU.  Multi-process tests use the real launchers (`accelerate launch`,
`torchrun`, `python -m torch.distributed.launch`) over gloo on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_CIFAR10 = REPO.parent / "shared" / "data" / "cifar10"
CONFIGS = REPO / "accelerate_configs"

# Small enough that a 2-process run finishes in well under a minute on 2 cores.
TINY_TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples",
              "64", "--model", "test_resnet", "--batch-size", "16", "--epochs", "1",
              "--progress", "log", "--no-plots"]


def test_env(**extra: str) -> dict:
    """Environment for child processes: offline, quiet, one thread each (2 cores, 2 ranks)."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run a command, capturing text output; on failure with check=True, show its output."""
    result = subprocess.run(cmd, cwd=cwd or REPO, env=env or test_env(), capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n"
                             f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def accel_train(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m accel_train ARGS` in a subprocess (a fresh process, as a user would run it)."""
    return run([sys.executable, "-m", "accel_train", *args], **kwargs)


@pytest.fixture
def shared_cifar10() -> Path:
    if not (SHARED_CIFAR10 / "train.parquet").exists():
        pytest.fail(f"the shared CIFAR-10 copy is missing at {SHARED_CIFAR10}")
    return SHARED_CIFAR10
