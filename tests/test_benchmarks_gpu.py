"""Smoke runs of the benchmark scripts written for a GPU, on a CPU (--allow-cpu: the same code
paths at a few steps; tests/benchmark_smoke.py says what they check).  A file apart from
tests/test_benchmarks.py so that the two run in parallel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmark_smoke import CASES, GPU_SCRIPTS, SCRIPTS, ran, run_script
from conftest import write_cifar10_layout

pytestmark = pytest.mark.slow  # every script with the programs it starts


@pytest.fixture(scope="module")
def cifar10_like(tmp_path_factory) -> Path:
    """The scripts' --data-dir: generated images in the layout of the shared CIFAR-10 copy."""
    return write_cifar10_layout(tmp_path_factory.mktemp("bench_cifar10"))


@pytest.mark.parametrize("name", [name for name in CASES if name in GPU_SCRIPTS])
def test_gpu_benchmark_script_runs_on_a_cpu(name, cifar10_like, tmp_path):
    run_script(name, cifar10_like, tmp_path)


def test_fp16_networks_writes_its_table_when_the_arms_spend_its_time(tmp_path):
    """--total-timeout (gpu_checks.sh's step limit less a margin): arms that would start past
    it are reported as not run, and the table is still written, where the step's own timeout
    would have killed the script with nothing written."""
    ran([sys.executable, str(SCRIPTS / "bench_fp16_networks.py"), "--quick", "--allow-cpu",
         "--models", "test_resnet", "resnet18", "--total-timeout", "0", "--out",
         str(tmp_path)], "fp16_networks")
    rows = json.loads((tmp_path / "fp16_networks.json").read_text())["tables"][0]["rows"]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("test_resnet", "fp16", "not run"), ("test_resnet", "bf16", "not run"),
        ("resnet18", "fp16", "not run"), ("resnet18", "bf16", "not run")]
