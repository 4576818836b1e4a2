"""Smoke runs of the benchmark scripts written for a GPU, on a CPU (--allow-cpu: the same code
paths at a few steps; tests/benchmark_smoke.py says what they check).  A file apart from
tests/test_benchmarks.py so that the two run in parallel."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_smoke import CASES, GPU_SCRIPTS, run_script
from conftest import write_cifar10_layout

pytestmark = pytest.mark.slow  # every script with the programs it starts


@pytest.fixture(scope="module")
def cifar10_like(tmp_path_factory) -> Path:
    """The scripts' --data-dir: generated images in the layout of the shared CIFAR-10 copy."""
    return write_cifar10_layout(tmp_path_factory.mktemp("bench_cifar10"))


@pytest.mark.parametrize("name", [name for name in CASES if name in GPU_SCRIPTS])
def test_gpu_benchmark_script_runs_on_a_cpu(name, cifar10_like, tmp_path):
    run_script(name, cifar10_like, tmp_path)
