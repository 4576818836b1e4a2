"""Real launchers, real signals, two CPU processes over gloo on loopback.

* torchrun --max-restarts 1 and accelerate launch --max_restarts 1: SIGKILL one worker mid-epoch;
  the launcher restarts both, they resume from the newest valid checkpoint by themselves, and
  the final weights are bit-identical to an uninterrupted run.
* torchrun --nnodes 1:2 with the c10d rendezvous: a node dies (the other carries on alone) and
  a node joins (both continue together).
"""

from __future__ import annotations

import json
import socket
import sys
import time

import psutil
import pytest

from fault_entry import SLOW_DATA_ENV, SLOW_SAVE_ENV, STOP_ENV
from faults import (ENTRY, FAULT_TRAIN, SAMPLE_LOG_ENV, STALL_ENV, Run, accelerate_cmd,
                    assert_each_sample_once_per_epoch, assert_metrics_continuous,
                    checkpoint_steps, free_port, kill_worker, max_weight_difference, metrics,
                    torchrun_cmd, wait_for_stall, wait_until)

pytestmark = pytest.mark.slow

# Two processes x batch 16: 8 steps per epoch, 16 in all; saves at 3, 6, 8, 9, 12, 15, 16.
SAVES = [3, 6, 8, 9, 12, 15, 16]



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training on two processes, left alone."""
    base = tmp_path_factory.mktemp("reference")
    run = Run(torchrun_cmd(*FAULT_TRAIN, "--output-dir", str(base / "run")), base / "run.log")
    try:
        run.check()
    finally:
        run.close()
    return base / "run"


def test_torchrun_restarts_workers_killed_mid_save_and_ends_bit_identical(reference, tmp_path,
                                                                          runs, rng):
    """Rank 0 dies (SIGKILL) while writing the checkpoint of a random mid-epoch step."""
    stall_at = rng.choice([6, 9, 12, 15])
    previous = max(s for s in SAVES if s < stall_at)
    about = f"(rank 0 killed during the save of step {stall_at})"
    out = tmp_path / "run"
    run = Run(torchrun_cmd(*FAULT_TRAIN, "--output-dir", str(out), max_restarts=1),
              tmp_path / "run.log", **{STALL_ENV: str(stall_at)})
    runs.append(run)
    wait_for_stall(run, stall_at)
    kill_worker(run, rank=0)
    output = run.check()

    assert f"resumed from {out}/checkpoints/step_{previous:08d} at step {previous}" in output, \
        about
    assert "restart 1" in (out / "logs" / "rank1.log").read_text(), about
    assert not list((out / "checkpoints").glob(".tmp-*")), about
    assert max_weight_difference(reference, out) == 0.0, about
    assert_metrics_continuous(out, total_steps=16)


def test_accelerate_launch_restarts_after_a_worker_is_killed(reference, tmp_path, runs, rng):
    """Rank 1 dies (SIGKILL) as soon as a random checkpoint appears, wherever it then is."""
    after = rng.choice([3, 6, 9])
    out = tmp_path / "run"
    run = Run(accelerate_cmd(*FAULT_TRAIN, "--output-dir", str(out), max_restarts=1),
              tmp_path / "run.log")
    runs.append(run)
    wait_until(lambda: after in checkpoint_steps(out), f"checkpoint {after}", run)
    kill_worker(run, rank=1)
    output = run.check()

    about = f"(rank 1 killed after checkpoint {after} appeared)"
    assert "resumed from" in output and "restart 1" in output + _rank_logs(out), about
    assert max_weight_difference(reference, out) == 0.0, about
    assert_metrics_continuous(out, total_steps=16)


def _rank_logs(out) -> str:
    return "".join(p.read_text() for p in (out / "logs").glob("rank*.log"))


# -- a stalled rank -----------------------------------------------------------------------------
STALL_TIMEOUT = 3  # --collective-timeout in seconds, small for the test (default: >= 60 s)
# torchrun's wait between SIGTERM and SIGKILL when it stops a round (a SIGSTOPped rank never
# acts on the SIGTERM): 30 s by default, shortened here
QUICK_SHUTDOWN = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}


def test_a_stalled_rank_is_named_and_the_group_restarts_bit_identical(reference, tmp_path,
                                                                      runs):
    """Rank 1 stops (SIGSTOP, as a process stuck in a driver call looks from outside) as it
    starts step 5, after the first checkpoint, and is never continued.  (It stops itself
    (fault_entry's FAULT_STOP): a stop sent from here could land while rank 0 waits at a
    checkpoint's barrier, under the long timeout.)  Rank 0 waits in that step's collective
    for --collective-timeout, names rank 1 and its last step, writes its stacks to its log and
    exits 75; accelerate launch --max_restarts 1 restarts the group, which resumes from the
    newest checkpoint and ends with the weights of the run that never stalled."""
    out = tmp_path / "run"
    run = Run(accelerate_cmd(*FAULT_TRAIN, "--collective-timeout", str(STALL_TIMEOUT),
                             "--output-dir", str(out), max_restarts=1),
              tmp_path / "run.log", **{STOP_ENV: "1:5"}, **QUICK_SHUTDOWN)
    runs.append(run)
    rank1 = wait_until(lambda: run.workers().get(1), "worker rank 1", run)
    wait_until(lambda: rank1.status() == psutil.STATUS_STOPPED, "rank 1 stopped", run)
    stopped = time.monotonic()
    line = wait_until(lambda: [text for text in run.output.splitlines()
                               if "a collective waited" in text], "the stall reported", run)[0]
    noticed = time.monotonic() - stopped
    output = run.check()

    assert noticed < STALL_TIMEOUT + 10, f"the stall took {noticed:.1f} s to be reported"
    assert line.startswith("accel_train: error (rank 0): a collective waited 3 s for another "
                           "rank"), line
    assert "stalled: rank 1 (last completed step 4," in line, line
    assert "exit 75" in line and "logs/rank0.log" in line
    log0 = (out / "logs" / "rank0.log").read_text()
    waited = log0.split("stalled: rank 1")[1].split("Python stacks at")[0]
    assert "Traceback" in waited and "in train_step" in waited, "where rank 0 waited"
    assert "Python stacks at" in log0  # and every thread of it, as it was then
    assert "resumed from" in output and "restart 1" in _rank_logs(out)
    assert max_weight_difference(reference, out) == 0.0
    assert_metrics_continuous(out, total_steps=16)


def test_slow_data_preparation_and_a_slow_checkpoint_do_not_trip_the_tight_timeout(tmp_path,
                                                                                   runs):
    """Waits that keep healthy ranks waiting on purpose run under the long timeout: rank 0
    preparing the data 2x the tight timeout longer (before the first step), and the save of
    checkpoint 6 taking 2x the tight timeout longer (between steps).  The run finishes, and
    nothing timed out."""
    out = tmp_path / "run"
    run = Run(accelerate_cmd(*FAULT_TRAIN, "--collective-timeout", str(STALL_TIMEOUT),
                             "--output-dir", str(out)), tmp_path / "run.log",
              **{SLOW_DATA_ENV: str(2 * STALL_TIMEOUT),
                 SLOW_SAVE_ENV: f"6:{2 * STALL_TIMEOUT}"})
    runs.append(run)
    output = run.check()
    assert "rank 0 prepares the data" in output and "the save of step 6 takes" in output
    assert "a collective waited" not in output + _rank_logs(out)
    assert max(checkpoint_steps(out)) == 16


# -- elastic membership -------------------------------------------------------------------------
MEMBERSHIP_SAMPLES, MEMBERSHIP_STEPS = 4096, 128  # one epoch: long enough for a node to join


def _node(out, port: int, log) -> Run:
    """One 'machine': a torchrun agent with one worker, joining the c10d rendezvous at `port`.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's shared store, torch 2.14 never tells a
    node that joins later where the store is (it waits for MASTER_ADDR for 60 s and fails)."""
    train = [a for a in FAULT_TRAIN]
    for flag, value in (("--synthetic-train-size", str(MEMBERSHIP_SAMPLES)), ("--epochs", "1"),
                        ("--checkpoint-every", "8")):
        train[train.index(flag) + 1] = value
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "membership-test", "--rdzv-conf",
           "last_call_timeout=3", "--max-restarts", "3", "--monitor-interval", "0.5",
           "-m", ENTRY, *train, "--output-dir", str(out)]
    return Run(cmd, log, **{SAMPLE_LOG_ENV: "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _checkpoint_on(out, world_size: int, after: int = 0):
    """The step of a checkpoint written by `world_size` processes after step `after`, if any."""
    def find():
        for path in sorted((out / "checkpoints").glob("step_*")):
            try:
                state = json.loads((path / "trainer_state.json").read_text())
            except (OSError, ValueError):
                continue  # being renamed or pruned right now
            if state["world_size"] == world_size and state["step"] > after:
                return state["step"]
        return None
    return find


def test_a_node_leaves_and_a_node_joins(tmp_path, runs):
    out = tmp_path / "run"
    port = free_port()
    host = _node(out, port, tmp_path / "host.log")  # hosts the rendezvous store: must stay
    runs.append(host)

    def store_up():
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_until(store_up, "the rendezvous store", host)
    leaver = _node(out, port, tmp_path / "leaver.log")
    runs.append(leaver)
    together = wait_until(_checkpoint_on(out, 2), "a checkpoint written by 2 processes", host)
    leaver.kill_all()  # the machine dies: agent and worker, no goodbye

    alone = wait_until(_checkpoint_on(out, 1, after=together), "the survivor checkpointing alone",
                       host)
    joiner = _node(out, port, tmp_path / "joiner.log")
    runs.append(joiner)
    wait_until(_checkpoint_on(out, 2, after=alone), "a checkpoint by 2 processes again", host)
    assert host.wait() == 0 and joiner.wait() == 0, host.output[-3000:] + joiner.output[-3000:]

    resumes = [(r["previous_world_size"], r["world_size"], r["accumulation_steps"])
               for r in metrics(out) if r["type"] == "resume"]
    assert resumes[-2:] == [(2, 1, 2), (1, 2, 1)], resumes
    assert_metrics_continuous(out, total_steps=MEMBERSHIP_STEPS, epochs=1)
    assert_each_sample_once_per_epoch(out, num_samples=MEMBERSHIP_SAMPLES, epochs=1)
    assert "stopped by a signal" in host.output + joiner.output, \
        "a joining node makes the agent SIGTERM its worker, which saves before it goes"
