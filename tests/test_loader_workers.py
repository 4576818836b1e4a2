"""Loader workers that fail: one killed mid-epoch (the kernel's OOM killer does this when workers
x prefetch x image size outgrow memory) costs a warning, not the run: the workers start again at
the same position and the run ends in the weights of a run where nothing died.  One stuck
reading a file (a dead network mount) names the file itself, and the run stops in one line at
--loader-timeout.  A run in a program that goes on ends its workers itself when it returns."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Callable, Optional

import psutil
import pytest
import torch
from torch import nn
from torchvision.datasets import FakeData

import accel_train
from accel_train.callbacks import Callback
from conftest import accel_train_here
from fault_entry import BLOCK_READ_ENV, SAMPLE_LOG_ENV, STEP_SECONDS_ENV
from faults import (LOADER_WORKER_NAME, Run, max_weight_difference, metrics, metrics_so_far,
                    python_cmd, wait_until)

pytestmark = pytest.mark.slow

# One process, two loader workers, 256 synthetic images at batch 16: 16 steps, one epoch.
TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples", "64",
         "--model", "test_resnet", "--batch-size", "16", "--epochs", "1", "--num-workers", "2",
         "--log-every", "1", "--progress", "log", "--no-plots", "--mixed-precision", "no",
         "--no-channels-last"]


def _live_loader_workers(pid: Optional[int] = None) -> list[psutil.Process]:
    """The live loader workers under process `pid` (None: this one): children of its fork
    server, named by torch."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.name() == LOADER_WORKER_NAME and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:  # gone since the listing
            pass
    return found


def _loader_workers(run: Run) -> list[psutil.Process]:
    """The run's live loader workers."""
    return _live_loader_workers(run.proc.pid)


def assert_workers_from_fork_server(run: Run, preloaded: tuple[str, ...] = ()) -> None:
    """The run's loader workers came from one multiprocessing fork server that its training
    process started (never forked from the training process itself, whose threads' locks a fork
    would copy), with `preloaded` among the modules it imported first (its command line names
    them: `from multiprocessing.forkserver import main; main(..., [modules], ...)`)."""
    trainer = run.proc.pid
    # workers and their server read in one look: a worker seen a moment ago may be gone
    servers = wait_until(lambda: _parents_of_workers(run), "a loader worker's parent", run)
    assert len(servers) == 1, servers
    (parent, command), = servers.values()
    assert parent == trainer, (parent, trainer)
    assert "from multiprocessing.forkserver import main" in command, command
    for module in preloaded:
        assert repr(module) in command, (module, command)


def _parents_of_workers(run: Run) -> dict[int, tuple[int, str]]:
    """{pid: (its parent's pid, its command line)} of the processes the run's live loader
    workers came from; {} when none could be read (a worker or its parent gone meanwhile)."""
    servers = {}
    try:
        for worker in _loader_workers(run):
            server = psutil.Process(worker.ppid())
            servers[server.pid] = (server.ppid(), " ".join(server.cmdline()))
    except psutil.NoSuchProcess:
        return {}
    return servers


# The indexed loader with workers started each epoch or kept, and the streaming loader (whose new
# workers plan the rest of the epoch from the samples handed out, as a resumed start does).
KILLED_WORKER_CASES = {
    "workers-per-epoch": [*TRAIN, "--no-persistent-workers"],
    "persistent": [*TRAIN, "--persistent-workers"],
    "streaming": ["--model", "test_resnet", "--batch-size", "8", "--epochs", "1",
                  "--num-workers", "2", "--max-eval-samples", "32", "--shuffle-buffer", "50",
                  "--log-every", "1", "--progress", "log", "--no-plots", "--mixed-precision",
                  "no", "--no-channels-last"],
}


def _case_flags(cases: dict, case: str, request) -> list[str]:
    """A case's flags; the streaming case's read the synthetic shards."""
    flags = cases[case]
    if case == "streaming":
        flags = ["--data-dir", str(request.getfixturevalue("synthetic_shards")), *flags]
    return flags


@pytest.mark.parametrize("case", KILLED_WORKER_CASES)
def test_a_killed_loader_worker_costs_a_warning_and_the_run_ends_bit_identical(
        tmp_path, runs, case, request):
    flags = _case_flags(KILLED_WORKER_CASES, case, request)
    # the reference in this process: no process start, and another history of global draws
    accel_train_here(*flags, "--output-dir", str(tmp_path / "reference"), check=True)

    out = tmp_path / "run"
    run = Run(python_cmd(*flags, "--output-dir", str(out)), tmp_path / "run.log",
              **{STEP_SECONDS_ENV: "0.2"})
    runs.append(run)
    wait_until(lambda: any(r["type"] == "train" and r["step"] >= 5
                           for r in metrics_so_far(out)), "step 5", run)
    workers = wait_until(lambda: _loader_workers(run), "the loader workers", run)
    workers[0].send_signal(signal.SIGKILL)
    output = run.check()

    warnings = [line for line in output.splitlines() if "a loader worker died" in line]
    assert len(warnings) == 1, output[-3000:]
    assert f"pid(s) {workers[0].pid}" in warnings[0] or str(workers[0].pid) in warnings[0]
    assert "start again there" in warnings[0] and "--num-workers" in warnings[0]
    assert "Traceback" not in output
    train_steps = [r["step"] for r in metrics(out) if r["type"] == "train"]
    reference_steps = [r["step"] for r in metrics(tmp_path / "reference") if r["type"] == "train"]
    assert train_steps == reference_steps == list(range(1, len(reference_steps) + 1)), \
        "each step once"
    assert len(train_steps) >= 16
    assert max_weight_difference(tmp_path / "reference", out) == 0.0


@pytest.mark.parametrize("split, blocked, stop_at", [
    ("train", "100", "samples into epoch 1"),
    ("test", "held-out:5", "evaluating after step 1"),
], ids=["training", "held-out"])
def test_a_worker_stuck_reading_names_the_file_and_the_run_stops_in_one_line(
        cifar10_layout, tmp_path, runs, split, blocked, stop_at):
    """Image 100 of the training split (or image 5 of the held-out one, read at the first
    evaluation) of the parquet layout, decoded per batch (--in-memory never), blocks its read
    for an hour.  Its worker says which file it has been reading and for how long (with its
    stack), before the loader's 4 s run out; the run then ends in one line, exit 75 (a
    temporary failure: a restart may find the mount back), saying where it stood."""
    out = tmp_path / "run"
    run = Run(python_cmd("--data-dir", str(cifar10_layout), "--in-memory", "never",
                         "--model", "test_resnet", "--batch-size", "16", "--epochs", "1",
                         "--num-workers", "1", "--loader-timeout", "4", "--max-eval-samples",
                         "32", "--progress", "log", "--no-plots", "--mixed-precision", "no",
                         "--no-channels-last", "--output-dir", str(out),
                         # the held-out images read from test.parquet, not carved from train
                         *(["--max-steps", "1", "--select-on-test"] if split == "test" else [])),
              tmp_path / "run.log", **{BLOCK_READ_ENV: blocked})
    runs.append(run)
    output = run.check(expected=75)

    said = [line for line in output.splitlines() if "has been reading" in line]
    assert len(said) == 1, output[-3000:]
    assert said[0].startswith("accel_train: loader worker 0 (pid ")
    assert f"{split}" in said[0] and ".parquet" in said[0], said[0]
    # At 80% of the 4 s: 3 s, or 4 s when the machine is busy and the watch wakes late.
    assert re.search(r"more images\) for [34] s$", said[0]), said[0]
    assert "in blocking" in output.split(said[0])[1], "the worker's stack shows where it waits"
    last = output.strip().splitlines()[-1]
    assert last.startswith("accel_train: error: no batch from the loader workers in 4 s "
                           "(--loader-timeout)"), last
    assert stop_at in last, last
    assert "Traceback" not in output


def test_sigusr1_writes_the_stacks_of_a_hung_run_and_it_goes_on(cifar10_layout, tmp_path, runs):
    """A run waiting on a worker whose read blocks: SIGUSR1 to the training process and its
    loader worker (faults.Run.ask_for_stacks, what a test that times out does before it kills)
    makes each write its Python stacks, and both go on: the run still ends by --loader-timeout
    (exit 75), not by the signal."""
    run = Run(python_cmd("--data-dir", str(cifar10_layout), "--in-memory", "never",
                         "--model", "test_resnet", "--batch-size", "16", "--epochs", "1",
                         "--num-workers", "1", "--loader-timeout", "10", "--max-eval-samples",
                         "32", "--progress", "log", "--no-plots", "--mixed-precision", "no",
                         "--no-channels-last", "--output-dir", str(tmp_path / "run")),
              tmp_path / "run.log", **{BLOCK_READ_ENV: "100"})
    runs.append(run)
    # The worker's own watch speaks at 8 s, with its stack: from then on it is blocked.
    wait_until(lambda: "has been reading" in run.output, "the worker's note of a stuck read", run)
    before = run.output
    assert "in _try_get_data" not in before, before[-3000:]
    assert_workers_from_fork_server(run, preloaded=("datasets",))  # the parquet reader's
    run.ask_for_stacks(seconds=0.5)
    asked = run.output[len(before):]
    assert "in blocking" in asked, asked[-3000:]  # the worker, inside the blocked read
    assert "in _try_get_data" in asked, asked[-3000:]  # the training process, waiting for it
    assert run.check(expected=75)


def test_eval_with_workers_starts_them_from_a_fork_server_and_stops_when_one_is_stuck(
        cifar10_layout, tmp_path, runs):
    """`accel-train eval RUN --num-workers 1` starts its workers from a fork server too, Hugging
    Face datasets among its preloads (the parquet layout is read with it): seen while the
    worker's first read of a held-out image blocks (any: --max-samples keeps a subset of rows,
    and a row the subset lacks is never read; the worker then lives some 50 ms).  That read
    never ends: the worker names it, and eval stops at its --loader-timeout in one line, exit
    75, as training does (it waited for ever before)."""
    run_dir = tmp_path / "run"
    accel_train_here("--data-dir", str(cifar10_layout), "--model", "test_resnet", "--batch-size",
                     "16", "--max-steps", "1", "--max-eval-samples", "32", "--progress", "log",
                     "--no-plots", "--mixed-precision", "no", "--no-channels-last",
                     "--output-dir", str(run_dir), check=True)
    run = Run(python_cmd("eval", str(run_dir), "--num-workers", "1", "--max-samples", "32",
                         "--loader-timeout", "8"),
              tmp_path / "eval.log", **{BLOCK_READ_ENV: "held-out:*"})
    runs.append(run)
    wait_until(lambda: len(_loader_workers(run)) == 1, "the eval's loader worker", run)
    assert_workers_from_fork_server(run, preloaded=("datasets",))
    output = run.check(expected=75)

    said = [line for line in output.splitlines() if "has been reading" in line]
    assert len(said) == 1 and "train.parquet row" in said[0], output[-3000:]  # carved from train
    last = output.strip().splitlines()[-1]
    assert last == ("accel_train: error: no batch from the loader workers in 8 s "
                    "(--loader-timeout), evaluating the held-out split: a worker is stuck (its "
                    "own line above names what it was reading); exit 75, for another try once "
                    "the data can be read"), last
    assert "Traceback" not in output


def test_workers_start_while_another_thread_of_the_process_holds_a_lock_they_need():
    """A training process has threads when its loaders start workers (gloo's, queue feeders, the
    run lock's heartbeat): a worker must not start with a copy of a lock one of them held at that
    instant (a forked one does, and waits for it for ever: the loader's timeout ends that here)."""
    from held_lock import LOCK, NeedsTheLock

    from accel_train.data.loaders import make_loader

    release = threading.Event()

    def hold():
        with LOCK:
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        loader = make_loader(NeedsTheLock(), batch_size=2, num_workers=1, prefetch_factor=2,
                             persistent_workers=False, pin_memory=False, timeout=20)
        batches = [batch.tolist() for batch in loader]
    finally:
        release.set()
        holder.join()
    assert batches == [[0, 1], [2, 3]]


def test_a_stop_sent_to_the_whole_process_group_leaves_the_workers_to_finish_the_step(tmp_path,
                                                                                       runs):
    """torchrun stops a worker with SIGTERM to its whole process group, where the fork server
    that starts the loader workers lives too.  The run finishes its optimizer step (8
    micro-batches of at least 1 s) with the workers it has, then saves: a server killed by that
    signal takes its workers with it (a worker whose parent is gone leaves within 5 s) and the
    step's last micro-batches would need its workers started again."""
    out = tmp_path / "run"
    run = Run(python_cmd(*TRAIN, "--batch-size", "2", "--accumulation-steps", "8",
                         "--prefetch-factor", "1", "--output-dir", str(out)),
              tmp_path / "run.log", **{STEP_SECONDS_ENV: "1", SAMPLE_LOG_ENV: "1"})
    runs.append(run)
    # The signal lands once step 2's first micro-batch has begun (seven more of 1 s each to
    # go): sent at step 1's record, a loaded machine may deliver it before step 2 begins, and
    # the run then rightly stops at step 1 without a step to finish.
    wait_until(lambda: _micro_batches_begun(out, step=2) >= 1, "step 2's first micro-batch", run)
    os.killpg(run.proc.pid, signal.SIGTERM)  # the run is its own group's leader (Run)
    output = run.check(expected=143)
    assert "stopped by a signal at step 2" in output, output[-3000:]
    assert "a loader worker died" not in output, output[-3000:]
    assert "Traceback" not in output


def _micro_batches_begun(out: Path, step: int) -> int:
    """How many micro-batches of optimizer step `step` rank 0 has begun (fault_entry's log)."""
    log = out / "logs" / "samples-rank0.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if line.endswith("}") and json.loads(line)["step"] == step)


def test_a_training_process_killed_outright_takes_its_workers_and_their_server_along(tmp_path,
                                                                                      runs):
    """SIGKILL (the OOM killer, torchrun's last resort) gives the training process no time to
    stop its workers.  Their parent is the fork server, which outlives it: they must notice the
    training process is gone themselves, or they and the server wait for work for ever."""
    run = Run(python_cmd(*TRAIN, "--output-dir", str(tmp_path / "run")), tmp_path / "run.log",
              **{STEP_SECONDS_ENV: "0.5"})
    runs.append(run)
    wait_until(lambda: len(_loader_workers(run)) == 2, "the loader workers", run)
    assert_workers_from_fork_server(run)
    left_behind = psutil.Process(run.proc.pid).children(recursive=True)
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    gone, alive = psutil.wait_procs(left_behind, timeout=20)
    assert not alive, f"still running after the training process was killed: {alive}"


class StopAtStep(Callback):
    """SIGTERM to this process at `step` (what a scheduler sends): the run saves and stops."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _worker_pids() -> set[int]:
    """The pids of this process's live loader workers."""
    return {worker.pid for worker in _live_loader_workers()}


class WorkersSeen(Callback):
    """The loader workers alive at each training step's end."""

    def __init__(self):
        self.seen: set[int] = set()

    def on_step_end(self, trainer, step: int) -> None:
        self.seen |= _worker_pids()


def _workers_left_by(run: Callable[[list[Callback]], None]) -> set[int]:
    """`run(callbacks)`, a run in this process, with the cyclic garbage collector off (the
    workers of a loader it frees are ended in time, a loader in a reference cycle's are not):
    the loader workers it started that are still alive when it returns (it started some)."""
    before, watch = _worker_pids(), WorkersSeen()
    gc.disable()
    try:
        run([watch])
        left = _worker_pids() - before
    finally:
        gc.enable()
    assert watch.seen - before, "the run trained with no loader worker"
    return left


def _cli_run(*args: str, expected: int = 0, callbacks=()) -> Callable[[list[Callback]], None]:
    """`accel_train ARGS` called in this process (cli.main), ending with `expected`."""
    def run(watching: list[Callback]) -> None:
        result = accel_train_here(*args, callbacks=[*watching, *callbacks])
        assert result.returncode == expected, result.stderr[-3000:]
    return run


# Each loader that keeps workers between passes: the training and held-out loaders' (kept
# across epochs), the erasing plans' of data held on the device, and a resumed epoch's; and the
# streaming loader, whose workers are started each epoch.
RUN_END_CASES = {
    "finished": [*TRAIN, "--persistent-workers"],
    "data-on-device": [*TRAIN, "--persistent-workers", "--data-on-device", "always", "--reprob",
                       "0.25"],
    "streaming": KILLED_WORKER_CASES["streaming"],
}


@pytest.mark.parametrize("case", RUN_END_CASES)
def test_a_run_in_a_process_that_goes_on_ends_its_loader_workers_when_it_returns(
        tmp_path, case, request):
    """fit(), or the command line called in a program: when the run returns, its loader workers
    are gone.  Left to the garbage collector they are not: a run's loaders sit in reference
    cycles, and a collection that frees them ended each worker only after torch's 5-s join
    timeout (20 s of one gc.collect() after a run with 2 workers)."""
    flags = [*_case_flags(RUN_END_CASES, case, request), "--epochs", "2"]
    assert _workers_left_by(_cli_run(*flags, "--output-dir", str(tmp_path / "run"))) == set()


def test_fit_returns_with_its_loader_workers_ended(tmp_path):
    """The Python API's run, on a program's own datasets (torchvision's FakeData: PIL images)."""
    def run(callbacks: list[Callback]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(8, 2))
        images = {split: FakeData(size, (3, 16, 16), num_classes=2, random_offset=offset)
                  for split, size, offset in (("train", 64, 0), ("eval", 32, 1000))}
        accel_train.fit(model, images["train"], images["eval"], batch_size=16, epochs=2,
                        num_workers=2, persistent_workers=True, mixed_precision="no",
                        channels_last=False, plots=False, progress="log", callbacks=callbacks,
                        output_dir=str(tmp_path / "run"))
    assert _workers_left_by(run) == set()


@pytest.mark.parametrize("case", ["finished", "streaming"])
def test_a_run_stopped_by_a_signal_and_its_resumed_epoch_end_their_loader_workers(
        tmp_path, case, request):
    """Stopped by SIGTERM mid-epoch (exit 143), and then resumed mid-epoch (the indexed loader
    skips the batches already trained through a loader of its own): either way no loader
    worker outlives the run."""
    flags = [*_case_flags(RUN_END_CASES, case, request), "--checkpoint-every", "3",
             "--output-dir", str(tmp_path / "run")]
    assert _workers_left_by(_cli_run(*flags, expected=143, callbacks=[StopAtStep(5)])) == set()
    assert _workers_left_by(_cli_run(*flags, "--resume", "auto")) == set()
