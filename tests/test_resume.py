"""Exact resume in one process: SIGKILL in the middle of writing the checkpoint of a random
step, then `--resume auto` ends bit-identical to the run left alone."""

from __future__ import annotations

import pytest

import signal


from accel_train.run.checkpoint import verify
from conftest import accel_train_here
from faults import (FAULT_TRAIN, STALL_ENV, Run, assert_metrics_continuous, checkpoint_steps,
                    max_weight_difference, python_cmd, wait_for_stall)

# One process, batch 16: 16 steps per epoch, 32 in all; saves every 3 steps and at 16 and 32.
MID_EPOCH_SAVES = [6, 9, 12, 15, 18, 21, 24, 27, 30]



@pytest.mark.slow  # killed and restarted processes
def test_a_run_killed_while_writing_a_checkpoint_resumes_bit_identical(tmp_path, runs, rng):
    stall_at = rng.choice(MID_EPOCH_SAVES)
    previous = max(s for s in [*range(3, 33, 3), 16] if s < stall_at)
    about = f"(SIGKILL during the save of step {stall_at})"
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    victim = Run(python_cmd(*FAULT_TRAIN, "--output-dir", str(interrupted)),
                 tmp_path / "interrupted.log", **{STALL_ENV: str(stall_at)})
    runs.append(victim)
    # the reference and the resumed run in this process (the victim, killed, must be a
    # process of its own): no new process's seconds of imports
    accel_train_here(*FAULT_TRAIN, "--output-dir", str(reference), check=True)

    wait_for_stall(victim, stall_at)
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    half_written = interrupted / "checkpoints" / f".tmp-step_{stall_at:08d}"
    assert (half_written / "model.safetensors").is_file(), about
    assert not (half_written / "manifest.json").exists(), about
    assert checkpoint_steps(interrupted)[-1] == previous, about
    assert verify(interrupted / "checkpoints" / f"step_{previous:08d}") is None, about

    output = accel_train_here(*FAULT_TRAIN, "--output-dir", str(interrupted), "--resume",
                              "auto", check=True).stdout
    assert f"resumed from {interrupted}/checkpoints/step_{previous:08d} at step {previous}" \
        in output, about
    assert not half_written.exists(), about

    assert max_weight_difference(reference, interrupted) == 0.0, about
    records = assert_metrics_continuous(interrupted, total_steps=32)
    assert [r["step"] for r in records if r["type"] == "resume"] == [previous], about
