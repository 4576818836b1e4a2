"""Smoke test of the benchmark scripts: each runs in its smallest --quick form and prints its
table (a tiny model, a few steps, only the arms that start distinct programs).  The scripts run
in two lanes, each one process that runs its scripts in turn (tests/bench_lane.py).

Nothing here checks a speed or a ratio: those belong in benchmarks/BENCHMARKS.md, measured when
the machine is quiet, never in a timed test.  This only keeps the scripts runnable as the code
changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import conftest
from conftest import REPO

pytestmark = pytest.mark.slow  # every script in a fresh process, some with trainings

SCRIPTS = REPO / "benchmarks"
TINY = ["--quick", "--model", "test_resnet"]

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
    # both precisions in one process, as the GPU run does (each arm a new Accelerator)
    # both ways of starting workers, one round, a loader of two batches
    "worker_start": ["--quick", "--images", "128", "--rounds", "1"],
    "gpu": ["--quick", "--allow-cpu", "--model", "test_resnet", "--sizes", "32", "--precisions",
            "bf16", "fp16", "--batch", "8", "--steps", "1", "--rounds", "1"],
    # the recipe's settings on the embedded data with a small network; SIGTERM + resume
    "gpu_cifar": ["--quick", "--allow-cpu", "--no-compile"],
}

# Two lanes, each one process running its scripts in turn (tests/bench_lane.py: the seconds of
# imports a script's own process would pay, paid once a lane; the training runs they start
# through benchlib.run forked from a warm starter), balanced by each script's CPU seconds
# (the lanes' RESULTS.cpu.json; docs/development.md), the longest first.
LANES = [["accuracy", "scaling", "index", "seed", "overhead", "streaming", "comm", "checkpoint",
          "gpu"],
         ["gpu_cifar", "worker_start", "budget", "threads", "data", "efficiency", "precision"]]
ORDER = [name for lane in LANES for name in lane]


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    return tmp_path_factory.mktemp("lanes")


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory, cifar10_layout, lanes):
    # A smoke test: data in the CIFAR-10 parquet layout is enough (the real copy need not exist).
    data = ["--data-dir", str(cifar10_layout)]
    env = conftest.test_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")

    # made here, not in the threads: pytest creates its base temporary folder lazily, and two
    # threads asking for it at once can each create one (pytest-N and pytest-N+1)
    outs = {name: tmp_path_factory.mktemp(name) for name in ORDER}

    def job(name):
        out = outs[name]
        extra = ["--tmp", str(out)] if name not in ("comm", "gpu", "threads", "precision",
                                                               "worker_start", "gpu_cifar") else []
        return {"name": name, "script": str(SCRIPTS / f"bench_{name}.py"),
                "argv": [*CASES[name], "--out", str(out), *extra, *data],
                "log": str(out / "output.log")}

    def run_lane(index):
        jobs, results = lanes / f"lane{index}.json", lanes / f"lane{index}.results.json"
        jobs.write_text(json.dumps([job(name) for name in LANES[index]]))
        try:
            lane = subprocess.run([sys.executable, str(REPO / "tests" / "bench_lane.py"),
                                   str(jobs), str(results)], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=600)
            problem = "" if lane.returncode == 0 else \
                f"the lane exited {lane.returncode}: {lane.stderr[-3000:]}"
        except subprocess.TimeoutExpired:
            problem = "the lane timed out (600 s)"
        return json.loads(results.read_text()) if results.exists() else {}, problem

    with ThreadPoolExecutor(max_workers=2) as pool:
        lane_results = list(pool.map(run_lane, range(len(LANES))))
    codes, problems = {}, {}
    for (results, problem), names in zip(lane_results, LANES):
        codes.update(results)
        problems.update({name: problem for name in names})
    return {name: (outs[name], codes.get(name), problems[name]) for name in ORDER}


@pytest.mark.parametrize("name", ORDER)
def test_benchmark_script_runs(name, bench_runs):
    out, code, problem = bench_runs[name]
    log = (out / "output.log").read_text() if (out / "output.log").exists() else ""
    assert code is not None, f"bench_{name}.py did not finish: {problem}\n{log[-3000:]}"
    assert code == 0, f"bench_{name}.py exited {code}\n--- its output\n{log[-6000:]}"
    markdown = (out / f"{name}.md").read_text()
    assert "| " in markdown and "load average" in markdown, log[-2000:]
    data = json.loads((out / f"{name}.json").read_text())
    assert data["tables"] and data["machine"]["cores"] >= 1


def test_the_runs_the_scripts_start_are_forked_from_a_lanes_warm_starter(bench_runs, lanes):
    """benchlib.run's `python -m accel_train` and launcher children are forked (the seconds of
    imports they would pay are most of a smoke run's); a lane's starter writes its log when
    it starts (and LOG.refused the runs it had to leave to a new process)."""
    logs = [lanes / f"lane{index}.results.starter.log" for index in range(len(LANES))]
    assert any(log.exists() for log in logs), "no lane started its warm starter"


def test_every_benchmark_script_is_smoke_tested():
    assert sorted(p.stem[len("bench_"):] for p in SCRIPTS.glob("bench_*.py")) == sorted(CASES)


def test_the_airbench_anchor_trains_and_reports_each_tta_level(tmp_path):
    """benchmarks/anchors/airbench_cpu.py on generated data in the CIFAR-10 layout: 2 steps an
    epoch for 4 epochs (the averaging starts in the 4th), one JSON line with the three levels.
    Batch 128 instead of airbench's 1024: the same code path at an eighth of the arithmetic."""
    data = conftest.write_cifar10_layout(tmp_path / "cifar10", train_rows=256, test_rows=64)
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "anchors" / "airbench_cpu.py"), "--data-dir", str(data),
         "--epochs", "4", "--test-images", "64", "--batch-size", "128"],
        cwd=REPO, env=conftest.test_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 8 and report["epochs"] == 4.0
    # bf16 only where the CPU has it natively (emulated, it is many times slower than fp32)
    flags = Path("/proc/cpuinfo").read_text().split()
    assert report["precision"] == ("bf16" if {"avx512_bf16", "amx_tile"} & set(flags)
                                   else "fp32"), report
    assert all(0.0 <= report[f"top1_tta{level}"] <= 1.0 for level in (0, 1, 2))
