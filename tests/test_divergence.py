"""A run whose weights turn NaN stops in one line with exit 65 and writes nothing from then on:
the checkpoints before stay byte for byte, no newer checkpoint or model.safetensors appears
(accel_train/train/divergence.py).  Caught by the save that was about to happen (log windows longer
than the run) and by the first log window whose loss is not finite; with two ranks under
torchrun both stop, neither hangs.

A loss that stays NaN while the weights stay finite (fp16's gradient scaler skipping every step
of a forward pass that overflows; failing_nets.py makes it on a CPU) stops the run too: after
100 batches in a row, or at the end of a shorter start none of whose batches had a finite loss."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from accel_train import trainer
from accel_train.train.divergence import NonFiniteLosses, first_non_finite, stop_if_diverged
from accel_train.base.errors import DIVERGED_EXIT, RunStopped
import conftest
from conftest import REPO, TINY_TRAIN, accel_train_here, run
from failing_nets import NAN_CALLS_ENV, NAN_RANK_ENV
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


NAN_CAUSE = ("while the weights stayed finite, so nothing is being learned (under fp16 the "
             "gradient scaler skips every such step). A forward pass that overflows in fp16 is "
             "the usual cause: --mixed-precision bf16 (or no) computes it in a wider range; else "
             "lower --learning-rate, or look for NaN in the inputs")


def _nan_net(args: list[str]) -> list[str]:
    """`args` with failing_nets' NaN network as --model (test_resnet's place)."""
    return [("failing_nets:nan_while_training" if a == "test_resnet" else a) for a in args]


# batch 4 of 256 images: 64 steps an epoch, 128 in two; a record every 10 steps (the later
# --batch-size wins)
LONG_NAN_RUN = [*_nan_net(TWO_EPOCHS), "--batch-size", "4", "--log-every", "10"]


@pytest.mark.parametrize("accumulation, stopped_at", [(1, 100), (2, 50)])
def test_a_loss_nan_in_100_batches_in_a_row_stops_the_run(tmp_path, monkeypatch, accumulation,
                                                          stopped_at):
    """Batches 1-100 NaN: the record that holds the 100th (step 100; step 50 with two
    micro-batches a step, each a batch) stops the run, across an epoch's end (at step 64 or
    32, whose last steps have no record of their own)."""
    monkeypatch.setenv(NAN_CALLS_ENV, "1-100")
    out = tmp_path / "run"
    result = accel_train_here(*LONG_NAN_RUN, "--accumulation-steps", str(accumulation),
                              "--output-dir", str(out))
    assert result.returncode == DIVERGED_EXIT, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"accel_train: error: training stopped at step {stopped_at}: the training loss was NaN "
        f"or infinite in each of the last 100 batches, {NAN_CAUSE}; checkpoints written before "
        f"are intact")
    assert "Traceback" not in result.stderr
    assert not (out / "model.safetensors").exists()
    per_epoch = 64 // accumulation  # each epoch's end saves a checkpoint before the stop
    expected = [f"step_{step:08d}" for step in (per_epoch, 2 * per_epoch) if step < stopped_at]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == expected


def test_99_nan_batches_in_a_row_are_a_passing_overflow(tmp_path, monkeypatch):
    """The boundary: batch 100 finite, the run trains to its end."""
    monkeypatch.setenv(NAN_CALLS_ENV, "1-99")
    out = tmp_path / "run"
    result = accel_train_here(*LONG_NAN_RUN, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "model.safetensors").exists()


def test_a_short_start_without_one_finite_loss_writes_no_model(tmp_path, monkeypatch):
    """16 batches, every one NaN: fewer than 100, stopped at the end instead, before the final
    model; the same run with its last batch finite ends as usual."""
    short = _nan_net(TINY_TRAIN)
    monkeypatch.setenv(NAN_CALLS_ENV, "1-")
    result = accel_train_here(*short, "--output-dir", str(tmp_path / "all"))
    assert result.returncode == DIVERGED_EXIT, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"accel_train: error: training stopped at step 16: the training loss was NaN or "
        f"infinite in every one of this start's 16 batches, {NAN_CAUSE}; model.safetensors was "
        f"not written")
    assert not (tmp_path / "all" / "model.safetensors").exists()
    monkeypatch.setenv(NAN_CALLS_ENV, "1-15")
    result = accel_train_here(*short, "--output-dir", str(tmp_path / "last_finite"))
    assert result.returncode == 0, result.stderr[-3000:]


def test_batches_in_a_row_are_counted_by_hand():
    watch = NonFiniteLosses(limit=3)
    watch.add([False, False, True, False, False])
    assert (watch.in_a_row, watch.batches) == (2, 5)
    watch.stop_if_too_many(9)  # 2 < 3: nothing happens
    watch.stop_if_none_finite(9, "model.safetensors")  # one batch was finite
    watch.add([False])
    with pytest.raises(RunStopped) as stopped:
        watch.stop_if_too_many(9)
    assert stopped.value.exit_code == DIVERGED_EXIT
    assert "in each of the last 3 batches" in str(stopped.value)
    fresh = NonFiniteLosses(limit=3)
    fresh.stop_if_none_finite(0, "model.safetensors")  # a start that trained nothing
    fresh.add([False, False])
    with pytest.raises(RunStopped) as stopped:
        fresh.stop_if_none_finite(2, "model.safetensors")
    assert "every one of this start's 2 batches" in str(stopped.value)


@pytest.mark.slow  # two processes
def test_a_loss_nan_on_one_rank_stops_both(tmp_path):
    """Only rank 1's loss is NaN: the flags are reduced over the ranks, so both stop at the
    same record, neither waits for the other."""
    out = tmp_path / "run"
    result = run(torchrun_cmd(*LONG_NAN_RUN, "--output-dir", str(out)),
                 env=conftest.test_env(**{NAN_CALLS_ENV: "1-", NAN_RANK_ENV: "1",
                                          "PYTHONPATH": str(REPO / "tests")}), timeout=240)
    assert result.returncode != 0
    # two ranks of 4 images a batch: 64 steps in two epochs, so the end's check stops them
    assert result.stderr.count("the training loss was NaN or infinite in every one of this "
                               "start's 64 batches") == 2, result.stderr[-4000:]
    assert not (out / "model.safetensors").exists()
