"""Pre-emption with real signals: SIGTERM makes every worker finish its optimizer step, save a
checkpoint and exit 143; the next start with `--resume auto` continues from it, on however many
processes it is given (the global batch is kept by recomputing the accumulation steps)."""

from __future__ import annotations

import json
import signal

import pytest

from accel_train.run.checkpoint import verify
from conftest import accel_train_here
from fault_entry import SampleLog
from faults import (FAULT_TRAIN, SAMPLE_LOG_ENV, Run, assert_each_sample_once_per_epoch,
                    assert_metrics_continuous, checkpoint_steps, metrics, python_cmd,
                    torchrun_cmd, wait_until)



def _stopped_at(log_text: str) -> int:
    return int(log_text.split("stopped by a signal at step ")[1].split(":")[0])


def _saved_state(out, step: int) -> dict:
    path = out / "checkpoints" / f"step_{step:08d}"
    assert verify(path) is None, path
    return json.loads((path / "trainer_state.json").read_text())


@pytest.mark.slow
def test_preempted_on_one_then_two_processes_and_finished_on_one(tmp_path, runs):
    """1 process (16 x 1 x 2 accumulation) gets SIGTERM; the same command under torchrun on 2
    processes (16 x 2 x 1) resumes, and SIGTERM to torchrun (which forwards it to its workers)
    stops both at the same step; 1 process finishes.  Every sample of every epoch is used once
    across the three starts (the sample log records what each rank really trained on)."""
    out = tmp_path / "run"
    command = [*FAULT_TRAIN, "--accumulation-steps", "2", "--output-dir", str(out)]
    sample_log = {SAMPLE_LOG_ENV: "1"}

    # 1. one process, SIGTERM as soon as its first checkpoint exists
    first = Run(python_cmd(*command), tmp_path / "first.log", **sample_log)
    runs.append(first)
    wait_until(lambda: 3 in checkpoint_steps(out), "the first checkpoint", first)
    first.proc.send_signal(signal.SIGTERM)
    stop1 = _stopped_at(first.check(expected=143))
    assert 3 < stop1 < 16, "the stop comes at the next optimizer step, before the end"
    state = _saved_state(out, stop1)
    assert (state["world_size"], state["accumulation_steps"], state["global_batch"]) == (1, 2, 32)

    # 2. two processes under torchrun; SIGTERM to torchrun once they have saved a checkpoint
    second = Run(torchrun_cmd(*command, "--resume", "auto"), tmp_path / "second.log",
                 **sample_log)
    runs.append(second)
    later = wait_until(lambda: [s for s in checkpoint_steps(out) if s > stop1],
                       "a checkpoint by two processes", second)[0]
    second.proc.send_signal(signal.SIGTERM)
    second.wait()
    output = second.output
    assert f"resumed from {out}/checkpoints/step_{stop1:08d} at step {stop1}" in output
    assert "accumulation steps 2 -> 1" in output
    logs = [(out / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert "has no RNG state for rank 1" in logs[1]  # the checkpoint came from one process
    stops = [_stopped_at(log.split("resumed from")[-1]) for log in logs]
    assert stops[0] == stops[1] >= later, stops
    # torchrun forwarded SIGTERM to both workers; both exited on their own, with no traceback,
    # within its 30 s grace (it never escalated to SIGKILL).
    assert output.count("closing signal SIGTERM") == 2, output[-4000:]
    assert "closing signal SIGKILL" not in output and "]: Traceback" not in output
    state = _saved_state(out, stops[0])
    assert (state["world_size"], state["accumulation_steps"]) == (2, 1)

    # 3. one process again, to the end: in this process (no new process's imports)
    output = accel_train_here(*command, "--resume", "auto", check=True,
                              callbacks=[SampleLog(out / "logs", 0)]).stdout
    assert f"resumed from {out}/checkpoints/step_{stops[0]:08d}" in output
    assert "accumulation steps 1 -> 2" not in output  # the command already says 2
    final = _saved_state(out, 16)
    assert (final["world_size"], final["accumulation_steps"], final["epoch"]) == (1, 2, 2)

    resumes = [(r["previous_world_size"], r["world_size"]) for r in metrics(out)
               if r["type"] == "resume"]
    assert resumes == [(1, 2), (2, 1)]
    assert_metrics_continuous(out, total_steps=16)
    assert_each_sample_once_per_epoch(out)


def test_a_second_ctrl_c_stops_at_once_and_sigterm_only_asks():
    from accel_train.run.distributed import StopSignals

    stop = StopSignals()
    assert not stop.agreed()
    stop.request(signal.SIGTERM)
    stop.request(signal.SIGTERM)  # repeated by a scheduler: still a request
    assert stop.requested == signal.SIGTERM and stop.agreed()
    stop = StopSignals()
    stop.request(signal.SIGINT)
    assert stop.requested == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        stop.request(signal.SIGINT)
