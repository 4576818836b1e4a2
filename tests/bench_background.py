"""The benchmark smoke runs of tests/test_benchmarks.py, started as the session starts and run
at the machine's lowest CPU priority beside the other tests, which then only read what they wrote.

Why: the other tests leave a core idle whenever one of them waits on purpose (a stalled rank's
timeout, a requeued SLURM job, a rendezvous, a hung run's stacks): a fifth of the two cores'
time in a suite run (docs/development.md).  The smoke runs are CPU work that no test times, so
they can have those moments: the first pytest worker (gw0, or the only process without xdist)
starts them when the session starts (`start`, from conftest's session fixture), the lanes of
tests/bench_lane.py in the background, and conftest orders test_benchmarks.py last, so that
by the time a worker reaches it the lanes have mostly run in the gaps.  Whoever gets there first
starts them (an atomic mkdir decides), so the file alone (`pytest tests/test_benchmarks.py`)
works the same way.

The priority, by what the machine allows: a cgroup (v1 `cpu` controller) of its own with
`cpu.idle` (or the least `cpu.shares`), so every process the lanes start, whatever its session,
runs only where the other tests leave a core free (and a little when none is: measured about
8% of the cores against two busy ones, so a lane's two ranks do not starve); without one (not
root), nice 19 in a session of its own whose autogroup is niced 19 too (a launcher's ranks,
each in a session of its own, then run at the usual priority).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import conftest
from conftest import REPO

SCRIPTS = REPO / "benchmarks"
TINY = ["--quick", "--model", "test_resnet"]

# Each script's smallest --quick form (a tiny model, a few steps, only the arms that start
# distinct programs).
CASES = {
    "overhead": [*TINY, "--steps", "2", "--rounds", "1", "--memory-steps", "1", "--batch-size",
                 "16", "--memory-arms", "accel_train"],
    # no loader workers and no trainer runs here: the other cases start those programs
    "data": [*TINY, "--decode-images", "64", "--pipeline-images", "256", "--batches", "2",
             "--model-steps", "1", "--workers", "0", "--skip", "trainer", "--erase-batch", "32"],
    "scaling": [*TINY, "--pairs-only", "--steps", "4", "--log-every", "2", "--max-train", "512"],
    "seed": [*TINY, "--arms", "dataparallel", "accel1", "--images", "128", "--epochs", "1",
             "--workers", "0"],
    "comm": ["--quick", "--worlds", "2", "--max-bytes", "65536", "--min-seconds", "0.01",
             "--model", "test_resnet", "--heartbeat-batch", "8"],
    "checkpoint": ["--quick", "--models", "test_resnet", "--repeats", "1", "--step-repeats", "1"],
    # the seed loop is smoke-tested by "seed" (the same anchor script)
    "accuracy": [*TINY, "--recipes", "defaults", "--budget", "3", "--pilot-steps", "1", "--no-seed",
                 "--eval-samples", "64", "--seed-model", "test_resnet", "--workers", "0",
                 "--max-train", "512", "--recipe-file", "recipes/cifar10-cpu-10min.yaml",
                 "--recipe-file-extra", "--max-steps 2 --batch-size 16"],
    "threads": [*TINY, "--steps", "1", "--conditions", "quiet"],
    # one loaded arm and its quiet reference: a budget run and a --max-steps run
    "budget": ["--quick", "--budget", "4", "--hog-seconds", "1", "--arms", "load first",
               "--extra=--model test_resnet --batch-size 16 --max-eval-samples 64 "
               "--num-workers 0"],
    # (the first-step arms start the same training command as every other smoke here)
    "index": ["--quick", "--sizes", "300", "--no-first-step"],
    "streaming": [*TINY, "--rss-batches", "4", "--steps", "4", "--skip", "first"],
    "precision": ["--quick", "--models", "test_resnet", "--batch", "8", "--rounds", "1",
                  "--matmul-size", "256"],
    # the trainer in process with timers around its parts; a tiny matmul for the peak
    "efficiency": ["--quick", "--model", "test_resnet", "--batch-size", "16", "--matmul-size",
                   "256"],
    # both ways of starting workers, one round, a loader of two batches
    "worker_start": ["--quick", "--images", "128", "--rounds", "1"],
    # both precisions in one process, as the GPU run does (each arm a new Accelerator)
    "gpu": ["--quick", "--allow-cpu", "--model", "test_resnet", "--sizes", "32", "--precisions",
            "bf16", "fp16", "--batch", "8", "--steps", "1", "--rounds", "1"],
    # the recipe's settings on the embedded data with a small network; SIGTERM + resume
    "gpu_cifar": ["--quick", "--allow-cpu", "--no-compile"],
}
# The scripts that take no --tmp (they write nothing large)
NO_TMP = {"comm", "gpu", "threads", "precision", "worker_start", "gpu_cifar"}
# benchmarks/anchors/airbench_cpu.py on generated data in the CIFAR-10 layout: 2 steps an epoch
# for 4 epochs (the averaging starts in the 4th), one JSON line with the three levels.  Batch
# 128 instead of airbench's 1024: the same code path at an eighth of the arithmetic.
ANCHOR = "airbench_anchor"
ANCHOR_ARGS = ["--epochs", "4", "--test-images", "64", "--batch-size", "128"]

# Two lanes, each one process running jobs in turn (tests/bench_lane.py: the seconds of imports
# a script's own process would pay, paid once a lane; the training runs they start through
# benchlib.run forked from a warm starter).  They share one list and each takes the next job
# nobody has claimed as it comes free, so they end within about one job of each other on any
# machine; the list goes roughly longest first (the lanes' RESULTS.cpu.json, docs/development.md)
# so that the last jobs are short.  A fixed split per lane ended up to a minute apart, one core
# idle all that while, as the jobs' costs moved with the machine.
LANE_COUNT = 2
ORDER = ["threads", "worker_start", "index", "accuracy", "seed", "scaling", "gpu_cifar", ANCHOR,
         "overhead", "streaming", "comm", "budget", "data", "efficiency", "gpu", "precision",
         "checkpoint"]
LANE_TIMEOUT = 1500  # seconds from the start: the lanes mostly wait for free cores

CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
CGROUP_ACCOUNTING = Path("/sys/fs/cgroup/cpuacct")


def folder(basetemp: Path) -> Path:
    """Where the lanes work: beside the pytest workers' own folders (one per session)."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "bench-lanes"


def _cgroup_name() -> str:
    """The lanes' cgroup, named by the process that started them."""
    return f"accel-train-bench-{os.getpid()}"


def _jobs(root: Path) -> list[dict]:
    layout = conftest.write_cifar10_layout(root / "cifar10_layout")
    anchor_data = conftest.write_cifar10_layout(root / "anchor_cifar10", train_rows=256,
                                                test_rows=64)

    def job(name: str) -> dict:
        out = root / name
        out.mkdir()
        if name == ANCHOR:
            return {"name": name, "script": str(SCRIPTS / "anchors" / "airbench_cpu.py"),
                    "argv": ["--data-dir", str(anchor_data), *ANCHOR_ARGS],
                    "log": str(out / "output.log")}
        extra = [] if name in NO_TMP else ["--tmp", str(out)]
        return {"name": name, "script": str(SCRIPTS / f"bench_{name}.py"),
                "argv": [*CASES[name], "--out", str(out), *extra, "--data-dir", str(layout)],
                "log": str(out / "output.log")}

    return [job(name) for name in ORDER]


def start(basetemp: Path) -> list[subprocess.Popen]:
    """Start the lanes unless another process has (then []): their files go to
    folder(basetemp)."""
    root = folder(basetemp)
    try:
        root.mkdir(parents=True)
    except FileExistsError:
        return []
    env = conftest.test_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    cgroups = _low_priority_cgroup()
    lanes = []
    jobs_file = root / "jobs.json"
    jobs_file.write_text(json.dumps(_jobs(root)))
    for index in range(LANE_COUNT):
        lane = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "bench_lane.py"), str(jobs_file),
             str(root / f"lane{index}.results.json"), str(os.getpid())],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=(root / f"lane{index}.stderr").open("w"), start_new_session=True)
        _lower(lane.pid, cgroups)
        (root / f"lane{index}.pid").write_text(str(lane.pid))
        threading.Thread(target=_note_exit, args=(lane, root / f"lane{index}.exit"),
                         daemon=True).start()
        lanes.append(lane)
    return lanes


def _note_exit(lane: subprocess.Popen, path: Path) -> None:
    path.write_text(str(lane.wait()))


def _low_priority_cgroup() -> list[Path]:
    """A cgroup of the least CPU weight for the lanes (and where cgroup v1 mounts `cpuacct`
    apart, one there too: their CPU then counts apart from the tests', as
    tests/cpu_per_test.py reads it), or [] where none can be made."""
    name = _cgroup_name()
    try:
        (CGROUP_ROOT / name).mkdir()
        if (CGROUP_ROOT / name / "cpu.idle").exists():
            (CGROUP_ROOT / name / "cpu.idle").write_text("1")
        else:
            (CGROUP_ROOT / name / "cpu.shares").write_text("2")
    except OSError:
        return []
    groups = [CGROUP_ROOT / name]
    try:
        if CGROUP_ACCOUNTING.is_dir() and not CGROUP_ACCOUNTING.samefile(CGROUP_ROOT):
            (CGROUP_ACCOUNTING / name).mkdir()
            groups.append(CGROUP_ACCOUNTING / name)
    except OSError:
        pass
    return groups


def _lower(pid: int, cgroups: list[Path]) -> None:
    """The lane `pid` (before it starts anything: it is still importing) at the lowest
    priority: into `cgroups`, else nice 19 and its session's autogroup niced too."""
    try:
        for group in cgroups:
            (group / "cgroup.procs").write_text(str(pid))
        if cgroups:
            return
    except OSError:
        if cgroups and str(pid) in (cgroups[0] / "cgroup.procs").read_text().split():
            return  # (only the accounting one failed)
    os.setpriority(os.PRIO_PROCESS, pid, 19)
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:
        pass  # no autogroups here: nice alone orders the lanes below the tests


def finish(lanes: list[subprocess.Popen], stopped: bool) -> None:
    """At the session's end in the process that started them: the lanes waited for (killed
    when the session was stopped early), their cgroup removed."""
    for lane in lanes:
        try:
            if stopped:
                raise subprocess.TimeoutExpired(lane.args, 0)
            lane.wait(timeout=LANE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(lane.pid, signal.SIGKILL)
            lane.wait()
    for group in [*CGROUP_ROOT.glob(_cgroup_name()), *CGROUP_ACCOUNTING.glob(_cgroup_name())]:
        for _ in range(50):  # a lane's last forked runs may still be leaving it
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def results(basetemp: Path) -> dict[str, tuple[Path, int | None, str]]:
    """Wait for the lanes (whoever started them), then {job: (its folder, its exit code or
    None, why it has none)}."""
    root = folder(basetemp)
    started = time.monotonic()
    codes: dict[str, int] = {}
    problems = []
    for index in range(LANE_COUNT):
        problem = _wait_for_lane(root, index, started)
        if problem:
            problems.append(f"lane {index}: {problem}")
        done = root / f"lane{index}.results.json"
        codes.update(json.loads(done.read_text()) if done.exists() else {})
    return {name: (root / name, codes.get(name), "; ".join(problems) or
                   "no lane ran it") for name in ORDER}


def _wait_for_lane(root: Path, index: int, started: float) -> str:
    exit_file, pid_file = root / f"lane{index}.exit", root / f"lane{index}.pid"
    while time.monotonic() - started < LANE_TIMEOUT:
        if exit_file.exists() and exit_file.read_text():
            code = int(exit_file.read_text())
            return "" if code == 0 else \
                f"the lane exited {code}: {(root / f'lane{index}.stderr').read_text()[-3000:]}"
        if pid_file.exists() and not _alive(int(pid_file.read_text())):
            time.sleep(1)  # its starter notes the exit as it reaps it
            if not exit_file.exists():
                return "the lane ended and nobody saw its exit (its starter went away?)"
        time.sleep(0.5)
    return f"the lanes were not done {LANE_TIMEOUT} s after the wait began"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
