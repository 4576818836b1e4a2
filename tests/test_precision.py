"""Which precision really runs: `auto` is fp16 on CUDA and fp32 on a CPU (silently); an explicit
request that cannot run says so."""

from __future__ import annotations

import pytest
import yaml

from accel_train.precision import resolve_precision
from conftest import TINY_TRAIN, accel_train


@pytest.mark.parametrize("requested, cuda, used, warns", [
    ("auto", True, "fp16", False),   # tensor cores: the default on GPUs
    ("auto", False, "no", False),    # a CPU: fp32, and nobody asked for anything
    ("no", True, "no", False),
    ("bf16", False, "bf16", False),  # CPU autocast runs bf16 (natively, on this CPU kind)
    ("fp16", True, "fp16", False),
    ("fp16", False, "no", True),     # asked for and impossible: said, never silent
])
def test_precision_resolution(requested, cuda, used, warns):
    precision, warning = resolve_precision(requested, cuda, native_cpu_bf16=True)
    assert precision == used and (warning is not None) == warns


def test_bf16_on_a_cpu_without_native_bf16_runs_and_says_it_is_slow():
    precision, warning = resolve_precision("bf16", False, native_cpu_bf16=False)
    assert precision == "bf16" and "emulated" in warning and "--mixed-precision" in warning
    assert resolve_precision("auto", False, native_cpu_bf16=False) == ("no", None)


def test_the_default_on_a_cpu_trains_fp32_without_a_warning(tmp_path):
    out = tmp_path / "run"
    result = accel_train(*TINY_TRAIN, "--max-steps", "1", "--output-dir", str(out), check=True)
    assert "warning" not in (result.stdout + result.stderr).lower()
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert (resolved["precision_requested"], resolved["precision_used"]) == ("auto", "fp32")
    assert "precision fp32" in result.stdout
