"""Smoke runs of the benchmark scripts written for a CPU (tests/benchmark_smoke.py says what
they check), and of the airbench anchor; tests/test_benchmarks_gpu.py has the GPU scripts'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmark_smoke import ANCHOR_ARGS, CASES, GPU_SCRIPTS, SCRIPTS, ran, run_script
from conftest import cpu_flags_say_native_bf16, write_cifar10_layout

pytestmark = pytest.mark.slow  # every script with the programs it starts


@pytest.fixture(scope="module")
def cifar10_like(tmp_path_factory) -> Path:
    """The scripts' --data-dir: generated images in the layout of the shared CIFAR-10 copy."""
    return write_cifar10_layout(tmp_path_factory.mktemp("bench_cifar10"))


@pytest.mark.parametrize("name", [name for name in CASES if name not in GPU_SCRIPTS])
def test_benchmark_script_runs(name, cifar10_like, tmp_path):
    run_script(name, cifar10_like, tmp_path)


def test_every_benchmark_script_is_smoke_tested():
    assert sorted(p.stem[len("bench_"):] for p in SCRIPTS.glob("bench_*.py")) == sorted(CASES)
    assert GPU_SCRIPTS <= set(CASES)


def test_the_airbench_anchor_trains_and_reports_each_tta_level(tmp_path_factory):
    """benchmarks/anchors/airbench_cpu.py (ANCHOR_ARGS: 2 steps an epoch for 4 epochs) reports
    one JSON line with the three TTA levels and airbench's timer: the whitening, the epochs'
    loops and the final mirror-TTA evaluation, summed."""
    data = write_cifar10_layout(tmp_path_factory.mktemp("anchor_cifar10"), train_rows=256,
                                test_rows=64)
    stdout = ran([sys.executable, str(SCRIPTS / "anchors" / "airbench_cpu.py"), "--data-dir",
                  str(data), *ANCHOR_ARGS], "airbench_cpu.py")
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["steps"] == 8 and report["epochs"] == 4.0
    # bf16 only where the CPU has it natively (emulated, it is many times slower than fp32)
    assert report["precision"] == ("bf16" if cpu_flags_say_native_bf16() else "fp32"), report
    assert all(0.0 <= report[f"top1_tta{level}"] <= 1.0 for level in (0, 1, 2))
    parts = [report[k] for k in ("whitening_seconds", "training_seconds", "mirror_eval_seconds")]
    assert all(part > 0 for part in parts), report
    assert abs(report["timed_seconds"] - sum(parts)) <= 0.15, report   # each rounded
