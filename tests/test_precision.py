"""Which precision really runs: `auto` is fp16 on CUDA and, on a CPU, what autotune.py measured
(tests/test_autotune.py: the choice itself); an explicit request that cannot run says so."""

from __future__ import annotations

import json

import pytest
import yaml

from accel_train.precision import cpu_has_native_bf16, resolve_precision
from conftest import PINNED, TINY_TRAIN, accel_train_here


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


def test_the_default_on_a_cpu_is_chosen_said_recorded_and_kept_on_resume(tmp_path):
    """--mixed-precision auto and --channels-last auto (the defaults) through the real command:
    no warning, the choice and its figures in the summary and config.yaml, the checkpoint keeps
    it, and the resumed run takes it from there without timing anything again.  Which choice
    wins depends on this machine; what must hold does not.  (In this process: what the CLI
    runs, without the imports of a new one.)"""
    auto = TINY_TRAIN[:-len(PINNED)]
    assert TINY_TRAIN[-len(PINNED):] == PINNED
    out = tmp_path / "run"
    first = accel_train_here(*auto, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                             str(out), check=True)
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

    second = accel_train_here(*auto, "--max-steps", "3", "--output-dir", str(out), "--resume",
                              "auto", check=True)
    again = yaml.safe_load(sorted(out.glob("config.resume-*.yaml"))[-1].read_text())["resolved"]
    assert again["speed_timings"] == {}, "timed again after the resume"
    assert "precision and memory format kept from the checkpoint" in again["speed_choice"]
    assert (again["precision_used"], again["channels_last"]) == \
        (resolved["precision_used"], resolved["channels_last"])
    assert "kept from the checkpoint" in second.stdout


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
    from accel_train.precision import accelerate_fp16_note
    note = accelerate_fp16_note(requested, chosen, environ)
    if said is None:
        assert note is None
    else:
        assert "asks for mixed_precision fp16, which needs a CUDA device" in note and said in note
