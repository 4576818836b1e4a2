"""Process control through the real command line and launchers, never mocks:

* SIGTERM to ONE worker of a 2-process torchrun run stops both ranks at the same optimizer step
  (the ranks agree on stopping once per step);
* a real Ctrl-C (SIGINT) to `python -m accel_train` saves and exits 143; a second one while it is
  stopping exits 130 at once ("accel_train: interrupted") and loses no finished checkpoint;
* the manual start without a launcher (`--world_size 2 --rank R --dist_url tcp://...`, one
  command per process) trains one 2-process group, the same weights as torchrun;
* bad input on 2 processes exits 2 on every rank, promptly, in one line, without a traceback;
* exact resume also with images decoded per step by loader workers (--in-memory never
  --num-workers 2) at 80 px: stopped by SIGTERM mid-epoch and resumed, the final weights are
  bit-identical to a run left alone.

test_signals.py covers SIGTERM to a 1-process run and to torchrun itself (which forwards it to
every worker), and the SIGINT rules of the stop handler called directly; this file covers what
only real processes show.  Each random choice comes from a seeded RNG and is printed (set
ACCEL_TRAIN_TEST_SEED to replay or vary it).  Waits poll files, never sleep a fixed time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from accel_train.run.checkpoint import verify
from conftest import REPO, TINY_TRAIN, free_port, run
from conftest import test_env as child_env  # not test_*: pytest would collect it
from faults import (Run, checkpoint, checkpoint_steps, max_weight_difference, metrics, resolved,
                    stopped_at, wait_until)

# 256 synthetic images, batch 16: 16 steps per epoch on 1 process, 8 on 2, ~0.1 s a step.  Far
# longer (20 epochs) than any run that uses it lasts: each is stopped after its first
# checkpoints, and a signal must never find the run already finished.
LONG_TRAIN = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--epochs", "20",
              "--checkpoint-every", "3", "--log-every", "1", "--keep-checkpoints", "10"]
# The same with a network whose checkpoint is 86 MB (resnet18's weights and momentum): its save
# lasts a tenth of a second or more, a window a second SIGINT can be aimed at.
TWICE_TRAIN = [*[a for a in LONG_TRAIN if a not in ("--model", "test_resnet")], "--model",
               "resnet18"]
PROMPT = 60.0  # seconds: a bad input must end every rank well within this (imports included)



def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "accel_train", *args]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """The real CLI under the real torchrun (no restarts: a stop is the end of the run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            str(nproc), "--max-restarts", "0", "--monitor-interval", "0.5", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "accel_train", *args]


def workers(run: Run) -> dict[int, psutil.Process]:
    """The `python -m accel_train` processes under this launcher, by global rank."""
    found = {}
    try:
        children = psutil.Process(run.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # the launcher is gone: wait_until reports how it ended
        return found
    for child in children:
        try:
            environ, cmdline = child.environ(), child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in environ and "-m accel_train " in " ".join(cmdline) + " ":
            found[int(environ["RANK"])] = child
    return found


def wait_for_checkpoint(run: Run, out: Path, step: int) -> None:
    wait_until(lambda: max(checkpoint_steps(out), default=0) >= step,
               f"the checkpoint of step {step}", run)


# -- stop signals ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_to_one_worker_stops_both_ranks_at_the_same_step(tmp_path, runs, rng):
    """A scheduler or an administrator may signal one worker, not the launcher.  The ranks
    agree on the stop at the next optimizer step: both save the same checkpoint, both log the
    stop at that step and exit 143.  torchrun itself then reports a failed worker group: exit
    1, its ChildFailedError with the workers' 143."""
    out = tmp_path / "run"
    rank, after = rng.choice([0, 1]), rng.choice([3, 6])
    about = f"(SIGTERM to rank {rank} after checkpoint {after})"
    print(about)
    run = Run(torchrun(*LONG_TRAIN, "--output-dir", str(out)), tmp_path / "torchrun.log")
    runs.append(run)
    wait_for_checkpoint(run, out, after)
    target = wait_until(lambda: workers(run).get(rank), f"worker rank {rank}", run)
    target.send_signal(signal.SIGTERM)
    code = run.wait()
    output = run.output

    logs = [(out / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    stops = [stopped_at(log) for log in logs]
    assert stops[0] == stops[1] > after, (stops, about)
    state = checkpoint(out, stops[0])
    assert (state["step"], state["world_size"]) == (stops[0], 2), about
    assert stops[0] < 160, "the stop came before the run's end"
    assert max(checkpoint_steps(out)) == stops[0]
    assert max(r["step"] for r in metrics(out) if r["type"] == "train") == stops[0], about
    # What torchrun reports: the group failed (its ChildFailedError, exit 1), first failure a
    # worker's 143.  The other worker exits 143 too, unless torchrun saw the first one gone
    # while the other was still shutting down (its monitor looks every 0.5 s): then it
    # SIGTERMs it, after the checkpoint (both left the save's last barrier), and reports -15.
    assert code == 1, f"torchrun exited {code} {about}\n{output[-4000:]}"
    root_cause = output.split("Root Cause (first observed failure):")[1]
    summary = output[output.rindex("Failures:"):]
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", summary)]
    print(f"torchrun exit {code}; worker exit codes it reports: {codes}")
    assert re.search(r"exitcode\s*:\s*143 ", root_cause) and sorted(codes) in \
        ([143, 143], [-15, 143]), output[-4000:]
    assert "Signal 9" not in output and "]: Traceback" not in output, output[-4000:]
    assert output.count(f"stopped by a signal at step {stops[0]}:") == 1  # rank 0 prints


@pytest.mark.slow
def test_one_ctrl_c_saves_a_checkpoint_and_exits_143(tmp_path, runs, rng):
    out = tmp_path / "run"
    after = rng.choice([3, 6, 9])
    print(f"SIGINT after checkpoint {after}")
    run = Run(cli(*LONG_TRAIN, "--output-dir", str(out)), tmp_path / "run.log")
    runs.append(run)
    wait_for_checkpoint(run, out, after)
    run.proc.send_signal(signal.SIGINT)
    output = run.check(expected=143)
    stop = stopped_at(output)
    assert after < stop < 320, (after, stop)
    assert checkpoint(out, stop)["step"] == stop
    assert "interrupted" not in output and "Traceback" not in output, output[-3000:]
    for step in checkpoint_steps(out):
        assert verify(out / "checkpoints" / f"step_{step:08d}") is None, step


def _ctrl_c_twice(root: Path, runs: list, after: int) -> Optional[tuple[Run, list[int]]]:
    """One attempt: the first SIGINT once checkpoint `after` exists; then the process runs in
    bursts of about a millisecond, paused (SIGSTOP) between them while its checkpoint folder
    is read.  The first time a pause finds a new save unfinished (its .tmp- folder there), the
    second SIGINT is queued and the process resumed (SIGCONT), so that it arrives inside the
    save whatever the machine's speed (a save lasts a tenth of a second of the process's own
    running, many bursts).  None when a pause found the save already finished
    (the process is then let go to exit)."""
    out = root / "run"
    folder = out / "checkpoints"
    root.mkdir()
    run = Run(cli(*TWICE_TRAIN, "--output-dir", str(out)), root / "run.log")
    runs.append(run)
    wait_for_checkpoint(run, out, after)
    finished_before = checkpoint_steps(out)
    before = set(os.listdir(folder))
    process = psutil.Process(run.proc.pid)
    run.proc.send_signal(signal.SIGINT)
    # A save begun after the first SIGINT proves its handler ran (two SIGINTs that arrive
    # before Python's handler runs reach it as one).
    deadline = time.monotonic() + 120
    while True:
        process.suspend()
        new = set(os.listdir(folder)) - before
        if new:
            break
        process.resume()
        assert run.proc.poll() is None and time.monotonic() < deadline, \
            f"no save began after the first SIGINT (exit {run.proc.poll()})\n{run.output[-3000:]}"
        time.sleep(0.001)
    unfinished = {n for n in new if n.startswith(".tmp-step_")}
    print(f"new in the checkpoint folder: {sorted(new)}; unfinished save when paused: "
          f"{sorted(unfinished)}")
    if unfinished:
        run.proc.send_signal(signal.SIGINT)
    process.resume()
    if not unfinished:
        run.wait()
        return None
    return run, finished_before


@pytest.mark.slow
def test_a_second_ctrl_c_while_stopping_exits_130_and_loses_no_checkpoint(tmp_path, runs, rng):
    """The first Ctrl-C asks for a checkpoint at the next optimizer step; a second one while
    that is under way means "now": KeyboardInterrupt, `accel_train: interrupted`, exit 130
    (the stop handler's rule; test_signals.py calls the handler directly).  The save it cuts
    short never counts as a checkpoint; every finished checkpoint is still there, verified."""
    after = rng.choice([3, 6, 9])
    print(f"first SIGINT after checkpoint {after}")
    for attempt in range(3):  # should a save still finish between two pauses: again
        result = _ctrl_c_twice(tmp_path / f"attempt{attempt}", runs, after)
        if result is not None:
            break
    else:
        pytest.fail("three times the stop's save finished before the process could be paused")
    run, finished_before = result
    output = run.check(expected=130)
    assert "accel_train: interrupted" in output and "Traceback" not in output, output[-3000:]
    assert "stopped by a signal" not in output  # it never got as far as that
    folder = run.log.parent / "run" / "checkpoints"
    assert set(finished_before) <= set(checkpoint_steps(run.log.parent / "run"))
    for step in checkpoint_steps(run.log.parent / "run"):
        assert verify(folder / f"step_{step:08d}") is None, step
    assert any(n.startswith(".tmp-step_") for n in os.listdir(folder))  # the cut-short save


# -- the manual start without a launcher ----------------------------------------------------------

MANUAL = [*[a for a in TINY_TRAIN if a not in ("--batch-size", "16")], "--batch-size", "8",
          "--max-steps", "6", "--log-every", "1", "--no-augment"]


@pytest.mark.slow
def test_manual_start_without_a_launcher_trains_like_torchrun(tmp_path, runs):
    """The seed manual's start: one `python -m accel_train --world_size 2 --rank R --dist_url
    tcp://HOST:PORT` per process.  Both join one group and train what torchrun's 2 processes
    train from the same flags: the same global batch, steps and weights; only rank 0 prints."""
    manual, launched = tmp_path / "manual", tmp_path / "torchrun"
    url = f"tcp://127.0.0.1:{free_port()}"
    ranks = [Run(cli(*MANUAL, "--world_size", "2", "--rank", str(r), "--dist_url", url,
                     "--output-dir", str(manual)), tmp_path / f"manual_rank{r}.log")
             for r in (0, 1)]
    reference = Run(torchrun(*MANUAL, "--output-dir", str(launched)), tmp_path / "torchrun.log")
    runs.extend([*ranks, reference])
    outputs = [r.check() for r in ranks]
    reference.check()

    facts, expected = resolved(manual), resolved(launched)
    assert facts["world_size"] == 2 and facts["launcher"]["process_group_world_size"] == 2
    for key in ("world_size", "global_batch", "steps_per_epoch", "total_steps"):
        assert facts[key] == expected[key], key
    assert (facts["global_batch"], facts["total_steps"]) == (16, 6)
    for r in (0, 1):
        assert f"process rank {r} of 2 " in (manual / "logs" / f"rank{r}.log").read_text()
    assert [o.count("x 2 process(es), gloo") for o in outputs] == [1, 0], outputs[1][-2000:]
    assert [m["step"] for m in metrics(manual) if m["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    difference = max_weight_difference(manual, launched)
    print(f"max |manual - torchrun| weight difference: {difference}")
    assert difference == 0.0  # same group size, same gloo all-reduce: the same arithmetic


# -- bad input on every rank ----------------------------------------------------------------------

def _start_manual_pair(argv: list[str], **env: str) -> list[subprocess.Popen]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return [subprocess.Popen(cli(*argv, "--world_size", "2", "--rank", str(r), "--dist_url", url),
                             cwd=REPO, env=child_env(**env), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for r in (0, 1)]


@pytest.mark.slow
def test_bad_input_on_two_processes_exits_2_on_every_rank(tmp_path):
    """Each rank of a manual 2-process start (so that each rank's exit code and stderr are its
    own): exit 2, the one line naming the problem, no traceback, well within a minute.  The
    data is loaded on rank 0 first: its error must reach rank 1, not leave it waiting."""
    out, message = tmp_path / "run", "--data-dir /nonexistent/data: no such folder"
    started = time.monotonic()
    procs = _start_manual_pair([*TINY_TRAIN, "--data-dir", "/nonexistent/data", "--output-dir",
                                str(out)])
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=PROMPT)
            results.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    elapsed = time.monotonic() - started
    print(f"both ranks ended in {elapsed:.1f}s")
    for rank, (code, stdout, stderr) in enumerate(results):
        prefix = "accel_train: error: " if rank == 0 else "accel_train: error (rank 1): "
        lines = stderr.strip().splitlines()
        assert code == 2, f"rank {rank} exited {code}\n{stderr[-3000:]}"
        assert len(lines) == 1 and lines[0].startswith(prefix) and message in lines[0], stderr
        assert "Traceback" not in stdout + stderr
    assert not out.exists() or not any(out.iterdir()), sorted(os.listdir(out))


@pytest.mark.slow
def test_a_rank_that_crashes_is_named_with_its_error_by_the_rank_it_leaves(tmp_path):
    """Rank 1 of a manual start meets a bug in the user's network (its third training forward
    raises): it ends with its traceback (exit 1, the traceback in its log too); rank 0, left
    waiting in the step's all-reduce, names rank 1's error and step in its one line, not only
    a closed connection: the crash's own output may be on another machine."""
    out = tmp_path / "run"
    procs = _start_manual_pair([*TINY_TRAIN, "--model", "failing_nets:fails_on_rank_1",
                                "--output-dir", str(out)], PYTHONPATH=str(REPO / "tests"))
    results = []
    try:
        for proc in procs:
            _, stderr = proc.communicate(timeout=PROMPT)
            results.append((proc.returncode, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    (code0, err0), (code1, err1) = results
    assert code1 == 1 and "ZeroDivisionError: a bug only rank 1's batch meets" in err1, err1
    assert "ZeroDivisionError: a bug only rank 1's batch meets" in \
        (out / "logs" / "rank1.log").read_text()
    assert code0 == 75, err0
    # rank 0 stood after step N, waiting in step N + 1's all-reduce: the step rank 1 failed in
    standing = int(re.search(r"this is rank 0, at step (\d+);", err0).group(1))
    assert ("gone: rank 1 (ended on ZeroDivisionError: a bug only rank 1's batch meets in step "
            f"{standing + 1}; its traceback in its log, logs/rank1.log)") in err0, err0


@pytest.mark.slow
def test_bad_input_under_torchrun_exits_2_on_both_workers(tmp_path):
    """Under torchrun, with an error each rank finds on its own (the model name): each worker
    prints one line (torchrun tags its workers' lines with --tee) and exits 2; torchrun reports
    the group failed (exit 1).  A worker still exiting when torchrun's monitor (every 0.5 s)
    sees the other gone is SIGTERMed by torchrun (-15): the manual start above shows each
    rank's own exit code."""
    started = time.monotonic()
    command = torchrun(*TINY_TRAIN, "--model", "not_a_model", "--output-dir",
                       str(tmp_path / "run"))
    command[command.index("-m", 2):command.index("-m", 2)] = ["--tee", "3"]
    result = run(command, cwd=REPO, env=child_env(), timeout=PROMPT)
    print(f"torchrun ended in {time.monotonic() - started:.1f}s")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    summary = output[output.rindex("Failures:"):]
    codes = {int(rank): int(code) for rank, code in re.findall(
        r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", summary)}
    print(f"worker exit codes torchrun reports: {codes}")
    root_cause = summary.split("Root Cause (first observed failure):")[1]
    assert re.search(r"exitcode\s*:\s*2 ", root_cause), output[-4000:]
    assert sorted(codes) == [0, 1] and set(codes.values()) <= {2, -15}, output[-4000:]
    for rank, code in codes.items():
        lines = [line for line in output.splitlines()
                 if line.startswith(f"[default{rank}]:") and line.split(":", 1)[1].strip()]
        if code == 2:  # exited on its own: the one line
            assert len(lines) == 1 and "--model 'not_a_model' is not a timm model" in lines[0] \
                and lines[0].split(":", 1)[1].startswith("accel_train: error"), output[-4000:]
        else:  # SIGTERMed by torchrun: at most its line, nothing else
            assert len(lines) <= 1, output[-4000:]
    assert "]:Traceback" not in output.replace(" ", "")
