"""`--resume` with another --learning-rate takes it (optim.take_new_learning_rate): the optimizer's
and the scheduler's learning rates come back whole from a checkpoint, so without this the flag
was ignored without a word.  Oracle: a run started with the new rate logs the very same rate at
every step after the resume point; the resumed run says what changed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from accel_train.train.optim import take_new_learning_rate
from conftest import TINY_TRAIN, accel_train_here

TWO_EPOCHS = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--epochs", "2",
              "--log-every", "2", "--warmup-epochs", "0.5"]
STEPS_PER_EPOCH = 16  # 256 images, batch 16


def _logged_rates(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if r.get("type") == "train"}


@pytest.mark.slow
def test_a_resume_with_another_learning_rate_follows_a_run_started_with_it(tmp_path):
    first, fresh = tmp_path / "first", tmp_path / "fresh"
    accel_train_here(*TWO_EPOCHS, "--learning-rate", "0.1", "--output-dir", str(first),
                     check=True)
    before = _logged_rates(first)
    resumed = accel_train_here(*TWO_EPOCHS, "--learning-rate", "0.02", "--resume",
                               str(first / "checkpoints" / f"step_{STEPS_PER_EPOCH:08d}"),
                               "--output-dir", str(first), check=True)
    assert (f"--learning-rate 0.02 (the checkpoint's run had 0.1): the schedule goes on from "
            f"step {STEPS_PER_EPOCH}, scaled") in resumed.stdout
    accel_train_here(*TWO_EPOCHS, "--learning-rate", "0.02", "--output-dir", str(fresh),
                     check=True)
    after, oracle = _logged_rates(first), _logged_rates(fresh)
    later = [step for step in oracle if step > STEPS_PER_EPOCH]
    assert later and all(after[step] == pytest.approx(oracle[step], rel=1e-12) for step in later)
    assert all(after[step] != pytest.approx(before[step]) for step in later if before[step])


def test_the_same_learning_rate_says_nothing(tmp_path):
    out = tmp_path / "run"
    accel_train_here(*TWO_EPOCHS, "--max-steps", "20", "--output-dir", str(out), check=True)
    resumed = accel_train_here(*TWO_EPOCHS, "--resume", "auto", "--output-dir", str(out),
                               check=True)
    assert "resumed from" in resumed.stdout and "the checkpoint's run had" not in resumed.stdout


def test_the_rates_scale_on_a_bare_scheduler_as_on_accelerates():
    """The function takes torch's LambdaLR as well as Accelerate's wrapper around it; by hand:
    base 0.1 at factor 0.5 -> base 0.02 gives 0.01 now and after the next step."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = LambdaLR(optimizer, lambda step: 0.5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert take_new_learning_rate(optimizer, scheduler, [0.02]) == (0.1, 0.02)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert scheduler.get_last_lr() == [pytest.approx(0.01)] and scheduler.base_lrs == [0.02]
    assert optimizer.param_groups[0]["initial_lr"] == 0.02  # what a later scheduler would read
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert take_new_learning_rate(optimizer, scheduler, [0.02]) is None
