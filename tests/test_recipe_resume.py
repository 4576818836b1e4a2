"""Exact resume with the whole recipe on: Mixup and CutMix (switching), a RandAugment policy,
random erasing and the model EMA.  A run stopped by SIGTERM mid-epoch (after a checkpoint) and
continued with `--resume auto` ends bit-identical to the run left alone: the final
model.safetensors and the EMA weights of the last checkpoint, max |difference| 0.0; on 1 process
and on 2 under torchrun.

Oracle: the uninterrupted run of the same command.  Each mixing, policy and erasing draw must be
a function of the sample's place in the run, and the EMA must come back from the checkpoint,
for the two to agree to the bit.  Waits poll files; no fixed sleeps.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

from accel_train.checkpoint import verify
from conftest import TINY_TRAIN
from faults import Run, checkpoint_steps, max_weight_difference, metrics, torchrun_cmd, wait_until

RECIPE = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")],
          "--mixup", "0.8", "--cutmix", "1.0", "--mixup-switch-prob", "0.5",
          "--auto-augment", "rand-m9-mstd0.5-inc1", "--reprob", "0.25",
          "--model-ema", "--model-ema-decay", "0.9", "--drop-path", "0.1", "--drop-rate", "0.3",
          "--checkpoint-every", "3", "--log-every", "1", "--keep-checkpoints", "10"]



def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "accel_train", *args]


def _stopped_at(text: str) -> int:
    return int(text.split("stopped by a signal at step ")[1].split(":")[0])


def _state(out, step: int) -> dict:
    path = out / "checkpoints" / f"step_{step:08d}"
    assert verify(path) is None, f"{path}: {verify(path)}"
    return json.loads((path / "trainer_state.json").read_text())


def _ema(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "ema.safetensors"))


def _assert_same_end(reference, resumed, last_step: int, about: str) -> None:
    assert max_weight_difference(reference, resumed) == 0.0, about
    a, b = _ema(reference, last_step), _ema(resumed, last_step)
    assert a.keys() == b.keys()
    ema_difference = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert ema_difference == 0.0, f"EMA differs by {ema_difference} {about}"
    # the EMA is a real average here (decay 0.9), not a copy of the weights
    model = load_file(str(reference / "checkpoints" / f"step_{last_step:08d}" /
                          "model.safetensors"))
    assert max((a[k].double() - model[k].double()).abs().max().item() for k in a) > 0
    for out in (reference, resumed):
        epochs = [r for r in metrics(out) if r["type"] == "epoch"]
        assert epochs and all("eval_ema_top1" in r for r in epochs)
    assert [r["eval_ema_top1"] for r in metrics(reference) if r["type"] == "epoch"] == \
        [r["eval_ema_top1"] for r in metrics(resumed) if r["type"] == "epoch"], about
    train_steps = [r["step"] for r in metrics(resumed) if r["type"] == "train"]
    assert train_steps == list(range(1, last_step + 1)), (train_steps, about)


def test_recipe_resume_on_one_process_is_bit_identical(tmp_path, runs):
    """256 images, batch 16, one epoch: 16 steps, a checkpoint every 3."""
    command = [*RECIPE, "--epochs", "1"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    runs.append(Run(_cli(*command, "--output-dir", str(reference)), tmp_path / "reference.log"))
    victim = Run(_cli(*command, "--output-dir", str(stopped)), tmp_path / "stopped.log")
    runs.append(victim)
    wait_until(lambda: 3 in checkpoint_steps(stopped), "the checkpoint of step 3", victim)
    victim.proc.send_signal(signal.SIGTERM)
    stop = _stopped_at(victim.check(expected=143))
    about = f"(1 process, SIGTERM after checkpoint 3, stopped at {stop})"
    print(about)
    state = _state(stopped, stop)
    assert 0 < state["samples_in_epoch"] < 256, (state, about)  # mid-epoch
    assert (stopped / "checkpoints" / f"step_{stop:08d}" / "ema.safetensors").is_file()

    resumed = Run(_cli(*command, "--output-dir", str(stopped), "--resume", "auto"),
                  tmp_path / "resumed.log")
    runs.append(resumed)
    output = resumed.check()
    assert f"resumed from {stopped}/checkpoints/step_{stop:08d} at step {stop}" in output, about
    assert "holds no EMA" not in output
    runs[0].check()
    _assert_same_end(reference, stopped, 16, about)


@pytest.mark.slow
def test_recipe_resume_on_two_processes_is_bit_identical(tmp_path, runs):
    """torchrun, 2 processes x 16: 8 steps per epoch, two epochs, a checkpoint every 3; SIGTERM
    to torchrun (forwarded to both workers) after the checkpoint of step 3."""
    command = [*RECIPE, "--epochs", "2"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    runs.append(Run(torchrun_cmd(*command, "--output-dir", str(reference)),
                    tmp_path / "reference.log"))
    victim = Run(torchrun_cmd(*command, "--output-dir", str(stopped)), tmp_path / "stopped.log")
    runs.append(victim)
    wait_until(lambda: 3 in checkpoint_steps(stopped), "the checkpoint of step 3", victim)
    victim.proc.send_signal(signal.SIGTERM)
    victim.wait()
    logs = [(stopped / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    stops = [_stopped_at(log) for log in logs]
    assert stops[0] == stops[1], stops
    stop = stops[0]
    about = f"(2 processes, SIGTERM after checkpoint 3, stopped at {stop})"
    print(about)
    state = _state(stopped, stop)
    assert state["world_size"] == 2 and stop < 16, (state, about)

    resumed = Run(torchrun_cmd(*command, "--output-dir", str(stopped), "--resume", "auto"),
                  tmp_path / "resumed.log")
    runs.append(resumed)
    output = resumed.check()
    assert f"resumed from {stopped}/checkpoints/step_{stop:08d} at step {stop}" in output, about
    runs[0].check()
    _assert_same_end(reference, stopped, 16, about)
