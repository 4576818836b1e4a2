"""A loader worker killed mid-epoch (the kernel's OOM killer does this when workers x prefetch x
image size outgrow memory) costs a warning, not the run: the workers start again at the same
position and the run ends in the weights of a run where nothing died."""

from __future__ import annotations

import signal

import psutil
import pytest

from fault_entry import STEP_SECONDS_ENV
from faults import Run, max_weight_difference, metrics, python_cmd, wait_until

pytestmark = pytest.mark.slow

# One process, two loader workers, 256 synthetic images at batch 16: 16 steps, one epoch.
TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples", "64",
         "--model", "test_resnet", "--batch-size", "16", "--epochs", "1", "--num-workers", "2",
         "--log-every", "1", "--progress", "log", "--no-plots", "--mixed-precision", "no",
         "--no-channels-last"]


def _loader_workers(run: Run) -> list[psutil.Process]:
    return [child for child in psutil.Process(run.proc.pid).children()
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("persistent", [False, True], ids=["workers-per-epoch", "persistent"])
def test_a_killed_loader_worker_costs_a_warning_and_the_run_ends_bit_identical(tmp_path, runs,
                                                                              persistent):
    flags = [*TRAIN, "--persistent-workers" if persistent else "--no-persistent-workers"]
    reference = Run(python_cmd(*flags, "--output-dir", str(tmp_path / "reference")),
                    tmp_path / "reference.log")
    runs.append(reference)
    reference.check()

    out = tmp_path / "run"
    run = Run(python_cmd(*flags, "--output-dir", str(out)), tmp_path / "run.log",
              **{STEP_SECONDS_ENV: "0.2"})
    runs.append(run)
    wait_until(lambda: any(r["type"] == "train" and r["step"] >= 5 for r in metrics(out))
               if (out / "metrics.jsonl").is_file() else False, "step 5", run)
    workers = wait_until(lambda: _loader_workers(run), "the loader workers", run)
    workers[0].send_signal(signal.SIGKILL)
    output = run.check()

    warnings = [line for line in output.splitlines() if "a loader worker died" in line]
    assert len(warnings) == 1, output[-3000:]
    assert f"pid(s) {workers[0].pid}" in warnings[0] or str(workers[0].pid) in warnings[0]
    assert "start again there" in warnings[0] and "--num-workers" in warnings[0]
    assert "Traceback" not in output
    train_steps = [r["step"] for r in metrics(out) if r["type"] == "train"]
    assert train_steps == list(range(1, 17)), "each step once"
    assert max_weight_difference(tmp_path / "reference", out) == 0.0
