"""A run whose weights turn NaN stops in one line with exit 65 and writes nothing from then on:
the checkpoints before stay byte for byte, no newer checkpoint or model.safetensors appears
(accel_train/train/divergence.py).  Caught by the save that was about to happen (log windows longer
than the run) and by the first log window whose loss is not finite; with two ranks under
torchrun both stop, neither hangs."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from accel_train import trainer
from accel_train.train.divergence import first_non_finite, stop_if_diverged
from accel_train.base.errors import DIVERGED_EXIT, RunStopped
import conftest
from conftest import TINY_TRAIN, accel_train_here, run
from fault_entry import poison_weights_after
from faults import POISON_ENV, torchrun_cmd

TWO_EPOCHS = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--epochs", "2"]
STEPS_PER_EPOCH = 16  # 256 images, batch 16


def _poison_after(monkeypatch, wanted_step: int) -> None:
    """fault_entry's seam, in this process; monkeypatch puts the real train_step back after."""
    monkeypatch.setattr(trainer.Trainer, "train_step", trainer.Trainer.train_step)
    poison_weights_after(wanted_step)


def _files(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


CAUGHT = {  # the flags, and where the poisoned weights (after step 19) are caught, in what words
    # a step's checkpoint before any log window closes (an epoch too short for --log-every is
    # logged at its end: the log would catch it there)
    "caught-by-the-save": (["--log-every", "100", "--checkpoint-every", str(STEPS_PER_EPOCH + 4)],
                           f"at step {STEPS_PER_EPOCH + 4}: parameter conv1.0.weight holds NaN or "
                           f"infinite values; the checkpoint (step) was not written; checkpoints "
                           f"written before are intact."),
    "caught-by-the-log": (["--log-every", "2"],
                          f"at step {STEPS_PER_EPOCH + 4}: parameter conv1.0.weight holds NaN or "
                          f"infinite values; checkpoints written before are intact."),
    "caught-at-the-epochs-end": (["--log-every", "100"],
                                 f"at step {2 * STEPS_PER_EPOCH}: parameter conv1.0.weight holds "
                                 f"NaN or infinite values; checkpoints written before are "
                                 f"intact."),
}


@pytest.mark.parametrize("caught", list(CAUGHT))
def test_nan_weights_stop_the_run_and_keep_earlier_checkpoints(tmp_path, monkeypatch, caught):
    out = tmp_path / "run"
    _poison_after(monkeypatch, STEPS_PER_EPOCH + 3)  # in the second epoch
    flags, words = CAUGHT[caught]
    result = accel_train_here(*TWO_EPOCHS, *flags, "--output-dir", str(out))
    assert result.returncode == DIVERGED_EXIT == 65, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("accel_train: error: training diverged " + words), lines[-1]
    assert lines[-1].endswith("Lower --learning-rate (or set --grad-clip, or --mixed-precision "
                              "no) and go on from one of them with --resume, or train again")
    assert "Traceback" not in result.stderr
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == [f"step_{STEPS_PER_EPOCH:08d}"]  # the first epoch's, nothing after
    assert not (out / "model.safetensors").exists()
    saved = out / "checkpoints" / checkpoints[0]
    weights = list(saved.rglob("*.safetensors"))
    assert weights, "no weights in the first epoch's checkpoint"
    from safetensors.torch import load_file
    for path in weights:  # what was saved before is finite
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values())


def test_earlier_checkpoints_are_untouched_by_a_resumed_run_that_diverges(tmp_path,
                                                                             monkeypatch):
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--output-dir", str(out), check=True)
    before = _files(out / "checkpoints")
    model_before = (out / "model.safetensors").read_bytes()
    _poison_after(monkeypatch, STEPS_PER_EPOCH + 2)
    result = accel_train_here(*TWO_EPOCHS, "--log-every", "100", "--resume", "auto",
                              "--output-dir", str(out))
    assert result.returncode == DIVERGED_EXIT, result.stderr[-3000:]
    assert _files(out / "checkpoints") == before
    assert (out / "model.safetensors").read_bytes() == model_before


def test_the_check_names_the_first_non_finite_parameter():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert first_non_finite(model) is None
    stop_if_diverged(model, 7)  # finite: nothing happens
    with torch.no_grad():
        model[1].bias[1] = float("inf")
    assert first_non_finite(model) == "1.bias"
    with pytest.raises(RunStopped) as stopped:
        stop_if_diverged(model, 7, "the checkpoint (epoch end)")
    assert stopped.value.exit_code == DIVERGED_EXIT
    assert ("training diverged at step 7: parameter 1.bias holds NaN or infinite values; the "
            "checkpoint (epoch end) was not written" in str(stopped.value))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert first_non_finite(model) == "0.weight"


@pytest.mark.slow  # two processes
def test_two_ranks_both_stop_without_hanging(tmp_path):
    out = tmp_path / "run"
    result = run(torchrun_cmd(*TWO_EPOCHS, "--log-every", "100", "--output-dir", str(out)),
                 env=conftest.test_env(**{POISON_ENV: str(STEPS_PER_EPOCH // 2 + 3)}), timeout=240)
    assert result.returncode != 0
    assert result.stderr.count("training diverged at step") == 2, result.stderr[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        [f"step_{STEPS_PER_EPOCH // 2:08d}"]
    assert not (out / "model.safetensors").exists()


def test_no_run_diverges_by_default_on_an_ordinary_start(tmp_path):
    """Control: the same run without the poison finishes (the check does not misfire)."""
    out = tmp_path / "run"
    result = accel_train_here(*TWO_EPOCHS, "--log-every", "2", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "model.safetensors").exists()
