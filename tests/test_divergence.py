"""A run whose weights turn NaN stops in one line with exit 65 and writes nothing from then on:
the checkpoints before stay byte for byte, no newer checkpoint or model.safetensors appears
(accel_train/train/divergence.py).  Caught by the save that was about to happen (log windows longer
than the run) and by the first log window whose loss is not finite; with two ranks under
torchrun both stop, neither hangs.

A loss that stays NaN while the weights stay finite (fp16's gradient scaler skipping every step
of a forward pass that overflows; failing_nets.py makes it on a CPU) stops the run too: after
100 batches in a row, or at the end of a shorter start none of whose batches had a finite loss.
So does a finite loss whose gradients overflow fp16 at every scale: torch's own GradScaler backs
its scale off below fairseq's floor, 1e-4, after 30 skipped steps (counted by hand)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from accel_train import trainer
from accel_train.run import track
from accel_train.train.divergence import NonFiniteLosses, first_non_finite, loss_scale, \
    stop_if_diverged, stop_if_scale_collapsed
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


def _first_step_stopped(scaler, model, loss_of, steps: int):
    """Steps of torch's own GradScaler loop on `model`; the first whose scale the product
    stops at, or None."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        scaler.scale(loss_of(model)).backward()
        scaler.step(optimizer)
        scaler.update()
        try:
            stop_if_scale_collapsed(loss_scale(scaler), step)
        except RunStopped as stopped:
            assert stopped.exit_code == DIVERGED_EXIT
            assert "--mixed-precision bf16" in str(stopped)
            return step
    return None


def _sqrt_at_zero(model):
    """A finite loss (0) whose gradient is infinite at every scale: d sqrt(w) / dw at w = 0."""
    return torch.sqrt(model.weight).sum()


def test_a_finite_loss_whose_gradients_overflow_at_every_scale_stops_after_30_steps():
    """65536 halved at each skipped step: 2^16 * 2^-29 = 1.2e-4 stays, 2^16 * 2^-30 = 6.1e-5
    is below 1e-4."""
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    assert _first_step_stopped(scaler, model, _sqrt_at_zero, 40) == 30
    assert torch.equal(model.weight, torch.zeros_like(model.weight))  # every step skipped


def test_a_scaler_that_overflows_now_and_then_never_stops():
    """Finite gradients: the scale only grows (every 2 steps here); no scaler at all: None."""
    model = nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** -10, growth_interval=2)
    assert _first_step_stopped(scaler, model, lambda m: m(torch.ones(4, 3)).sum(), 40) is None
    assert loss_scale(None) is None
    assert loss_scale(torch.amp.GradScaler("cpu", enabled=False)) is None


def test_the_record_carries_the_scale_and_a_collapsed_one_stops_the_run(tmp_path, monkeypatch):
    """The trainer's records (every 2 steps) read the scale: fp16 runs only on CUDA, so here
    the scale the records read is handed in, 2^16 divided by 8 at each record: the tenth
    (step 20) reads 2^-11 = 4.9e-4, the 11th (step 22, in the second epoch) 2^-14 = 6.1e-5."""
    scales = iter(2.0 ** (16 - 3 * k) for k in range(100))
    monkeypatch.setattr(track, "loss_scale", lambda scaler: next(scales))
    out = tmp_path / "run"
    result = accel_train_here(*TWO_EPOCHS, "--log-every", "2", "--output-dir", str(out))
    assert result.returncode == DIVERGED_EXIT, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("accel_train: error: training stopped at step 22: fp16's gradient "
                           "scaler backed its scale off to 6.1e-05 (below 0.0001)"), last
    assert "Traceback" not in result.stderr
    assert not (out / "model.safetensors").exists()
    records = [r for r in track.read_metrics(out / "metrics.jsonl") if r["type"] == "train"]
    assert [r["loss_scale"] for r in records] == [2.0 ** (16 - 3 * k) for k in range(10)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        [f"step_{STEPS_PER_EPOCH:08d}"]


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
