"""Which precision really runs: `auto` is fp16 on CUDA and, on a CPU, what autotune.py measured
(tests/test_autotune.py: the choice itself); an explicit request that cannot run says so."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import sys

import pytest
import torch
import yaml

from accel_train.callbacks import Callback
from accel_train.train.precision import cpu_has_native_bf16, resolve_precision, use_fast_cuda_math
from conftest import (PINNED, TINY_TRAIN, accel_train_here, cpu_flags, cpu_flags_say_native_bf16,
                      run)


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


def test_fp16_without_cuda_says_what_runs_instead_and_what_to_ask_for():
    for activity in ("trains", "evaluates"):
        precision, warning = resolve_precision("fp16", False, activity, native_cpu_bf16=True)
        assert precision == "no"
        assert warning == (f"--mixed-precision fp16 needs a CUDA device; this run {activity} in "
                           f"fp32 (use --mixed-precision bf16 for reduced precision on CPU)")
    assert "this run trains in fp32" in resolve_precision("fp16", False)[1]  # the default


@pytest.mark.parametrize("supported", [True, False])
def test_bf16_on_a_gpu_without_bf16_runs_fp32_and_says_so(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: supported)
    precision, warning = resolve_precision("bf16", True, "evaluates")
    if supported:
        assert (precision, warning) == ("bf16", None)
    else:
        assert (precision, warning) == ("no", "this GPU has no bf16 support; this run "
                                              "evaluates in fp32")


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="reads the x86 CPU flags of /proc/cpuinfo")
def test_native_bf16_is_what_the_cpu_flags_say():
    """The kernel's list of CPU features is the oracle: AVX512-BF16 or AMX."""
    flags = cpu_flags()
    assert cpu_has_native_bf16() == cpu_flags_say_native_bf16(), sorted(
        f for f in flags if "bf16" in f or "amx" in f or f == "avx512f")


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="reads the x86 CPU flags of /proc/cpuinfo")
@pytest.mark.parametrize("flag, other_check", [
    ("avx512_bf16", "_is_amx_tile_supported"),    # e.g. AMD Zen 4: AVX512-BF16, no AMX
    ("amx_tile", "_is_avx512_bf16_supported"),
])
def test_either_feature_alone_is_native_bf16(monkeypatch, flag, other_check):
    """A CPU with one of the two features: the other's check answers no."""
    monkeypatch.setattr(torch.cpu, other_check, lambda: False)
    assert cpu_has_native_bf16() == (flag in cpu_flags())


@pytest.mark.slow  # a process of its own each (4 s of imports on the slowest machine kind)
@pytest.mark.parametrize("first", ["no", "bf16"])
def test_the_precision_a_process_holds_is_the_first_accelerators(first):
    """None until an Accelerator exists, then the precision it fixed for the process; read in
    a new process (the test's own may already hold one from an earlier test)."""
    program = ("from accelerate import Accelerator\n"
               "from accel_train.train.precision import precision_this_process_holds as held\n"
               f"before = held()\nAccelerator(cpu=True, mixed_precision={first!r})\n"
               "after = held()\nAccelerator(cpu=True)\nprint(before, after, held())\n")
    result = run([sys.executable, "-c", program], check=True)
    assert result.stdout.split() == ["None", first, first]


def test_fast_cuda_math_is_set_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    before = torch.get_float32_matmul_precision()
    try:
        assert use_fast_cuda_math(False) is None
        assert torch.backends.cudnn.benchmark is False
        assert torch.get_float32_matmul_precision() == before
        said = use_fast_cuda_math(True)
        assert torch.backends.cudnn.benchmark is True
        assert torch.get_float32_matmul_precision() == "high"
        assert said == "cuDNN autotuning on, TF32 matmuls for fp32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_bf16_on_a_cpu_without_native_bf16_runs_and_says_it_is_slow():
    precision, warning = resolve_precision("bf16", False, native_cpu_bf16=False)
    assert precision == "bf16"
    assert warning.startswith("--mixed-precision bf16: this CPU has no native bf16 (AVX512-BF16 "
                              "or AMX), so bf16 is emulated")
    assert "drop the flag" in warning
    assert resolve_precision("auto", False, native_cpu_bf16=False) == ("no", None)
    assert resolve_precision("no", False, native_cpu_bf16=False) == ("no", None)  # nothing to say


class StopAfterCheckpoint(Callback):
    """A real SIGTERM to this process once checkpoint `step` is written: the trainer's handler
    hears it as from a launcher and stops at the end of the next step (exit 143)."""

    def __init__(self, step: int):
        self.step = step

    def on_checkpoint(self, trainer, path) -> None:
        if path.name == f"step_{self.step:08d}":
            os.kill(os.getpid(), signal.SIGTERM)


def test_the_default_on_a_cpu_is_chosen_said_recorded_and_kept_on_resume(tmp_path):
    """--mixed-precision auto and --channels-last auto (the defaults) through the real command:
    no warning, the choice and its figures in the summary and config.yaml, the checkpoint keeps
    it, and the resumed run takes it from there without timing anything again.  4 epochs of
    256 images at 16: 1,024 images, 4 times the probe's 256 (2 rounds x 4 candidates x 2 steps
    x 16; without native bf16 2 candidates, 128): timed; each start stopped after a few steps.
    Which choice wins depends on this machine; what must hold does not.  (In this process:
    what the CLI runs, without the imports of a new one.)"""
    # (no warmup: one of an epoch would outlast the 2 steps, and the run would rightly warn)
    auto = [*TINY_TRAIN[:-len(PINNED)], "--warmup-epochs", "0", "--epochs", "4",
            "--checkpoint-every", "2"]
    assert TINY_TRAIN[-len(PINNED):] == PINNED
    out = tmp_path / "run"
    first = accel_train_here(*auto, "--output-dir", str(out), callbacks=[StopAfterCheckpoint(2)])
    assert first.returncode == 143, first.stdout[-2000:] + first.stderr[-2000:]
    assert "warning" not in (first.stdout + first.stderr).lower()
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    native = cpu_has_native_bf16()
    assert resolved["precision_requested"] == "auto"
    assert resolved["precision_used"] in (("fp32", "bf16") if native else ("fp32",))
    assert len(resolved["speed_timings"]) == (4 if native else 2)  # each candidate timed
    assert "fastest of" in resolved["speed_choice"] and resolved["speed_choice"] in first.stdout
    assert ("no native bf16" in resolved["speed_choice"]) == (not native)
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json")
                       .read_text())
    chosen = (state["precision"], state["channels_last"])
    assert chosen == ({"fp32": "no"}.get(resolved["precision_used"], resolved["precision_used"]),
                      resolved["channels_last"])

    second = accel_train_here(*auto, "--output-dir", str(out), "--resume", "auto",
                              callbacks=[StopAfterCheckpoint(4)])
    assert second.returncode == 143, second.stdout[-2000:] + second.stderr[-2000:]
    again = yaml.safe_load(sorted(out.glob("config.resume-*.yaml"))[-1].read_text())["resolved"]
    assert again["speed_timings"] == {}, "timed again after the resume"
    assert "precision and memory format kept from the checkpoint" in again["speed_choice"]
    assert (again["precision_used"], again["channels_last"]) == \
        (resolved["precision_used"], resolved["channels_last"])
    assert "kept from the checkpoint" in second.stdout


def test_a_run_too_short_to_pay_for_the_timing_trains_in_pytorchs_defaults(tmp_path):
    """2 steps of 16 images: 32 images, under 4 times the probe's (256 with native bf16, 128
    without): nothing timed, fp32 and NCHW, and the summary and config.yaml say why."""
    out = tmp_path / "run"
    run = accel_train_here(*TINY_TRAIN[:-len(PINNED)], "--warmup-epochs", "0", "--max-steps",
                           "2", "--output-dir", str(out), check=True)
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert (resolved["precision_used"], resolved["channels_last"], resolved["speed_timings"]) \
        == ("fp32", False, {})
    candidates, probe, line = (4, 256, "1,024") if cpu_has_native_bf16() else (2, 128, "512")
    said = (f"PyTorch's defaults, not timed: this run trains 32 images a process and timing "
            f"its {candidates} candidates would train {probe} (auto times runs of {line} or "
            f"more)")
    assert resolved["speed_choice"].endswith(said) and said in run.stdout, resolved


def test_an_explicit_precision_wins_over_the_checkpoints_on_resume(tmp_path):
    """Only auto takes the checkpoint's choice: a run trained in bf16 and resumed with
    --mixed-precision no trains on in fp32, and says nothing was kept."""
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--mixed-precision", "bf16", "--max-steps", "2",
                     "--checkpoint-every", "1", "--output-dir", str(out), check=True)
    accel_train_here(*TINY_TRAIN, "--mixed-precision", "no", "--max-steps", "3", "--output-dir",
                     str(out), "--resume", "auto", check=True)
    again = yaml.safe_load(sorted(out.glob("config.resume-*.yaml"))[-1].read_text())["resolved"]
    assert again["precision_used"] == "fp32" and "kept" not in again["speed_choice"]


@pytest.mark.parametrize("requested, chosen, environ, said", [
    ("auto", "no", {"ACCELERATE_MIXED_PRECISION": "fp16"}, "this run uses fp32"),
    ("auto", "bf16", {"ACCELERATE_MIXED_PRECISION": "fp16"}, "this run uses bf16"),
    ("auto", "fp16", {"ACCELERATE_MIXED_PRECISION": "fp16"}, None),  # a GPU: as answered
    ("bf16", "bf16", {"ACCELERATE_MIXED_PRECISION": "fp16"}, None),  # the flag won: nothing to say
    ("auto", "no", {"ACCELERATE_MIXED_PRECISION": "no"}, None),
    ("auto", "no", {}, None),
])
def test_the_accelerate_fp16_answer_is_said_where_auto_chose_otherwise(requested, chosen,
                                                                        environ, said):
    from accel_train.train.precision import accelerate_fp16_note
    note = accelerate_fp16_note(requested, chosen, environ)
    if said is None:
        assert note is None
    else:
        assert "asks for mixed_precision fp16, which needs a CUDA device" in note and said in note


def test_the_help_states_the_accelerate_config_rule_that_runs_follow(tmp_path, monkeypatch):
    """--help says once which of an accelerate config's mixed_precision values count as asked
    and which as not chosen (auto), with the reason; a tiny run under each value (what
    `accelerate launch` exports: ACCELERATE_MIXED_PRECISION) records that choice."""
    from accel_train.cli import build_train_parser

    text = " ".join(build_train_parser().format_help().split())
    rule = re.search(r"Under accelerate launch, its config's (\w+) counts as asked and its "
                     r"(\w+) and (\w+) as not chosen \(auto\), because [^.]+\.", text)
    assert rule, "--mixed-precision's help no longer states the accelerate config's rule"
    asked, unchosen = {rule[1]}, {rule[2], rule[3]}
    assert asked | unchosen == {"no", "fp16", "bf16"}, rule[0]
    tiny = [*TINY_TRAIN[:-len(PINNED)], "--no-channels-last", "--synthetic-train-size", "32",
            "--max-eval-samples", "16", "--max-steps", "1"]
    for value in sorted(asked | unchosen):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
        out = tmp_path / value
        ran = accel_train_here(*tiny, "--output-dir", str(out), check=True)
        record = yaml.safe_load((out / "config.yaml").read_text())
        expected = value if value in asked else "auto"
        assert record["resolved"]["precision_requested"] == expected, value
        if value in asked:  # a CPU runs bf16 as asked (emulated where not native)
            assert record["resolved"]["precision_used"] == value
            assert f"precision {value}" in ran.stdout, ran.stdout
