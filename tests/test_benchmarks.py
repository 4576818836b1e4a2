"""Smoke test of the benchmark scripts: each runs in its smallest --quick form and prints its
table (a tiny model, a few steps, only the arms that start distinct programs).  The scripts run
in two lanes, each one process that runs its scripts in turn (tests/bench_lane.py), started in
the background at the lowest CPU priority as the session starts (tests/bench_background.py).

Nothing here checks a speed or a ratio: those belong in benchmarks/BENCHMARKS.md, measured when
the machine is quiet, never in a timed test.  This only keeps the scripts runnable as the code
changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_background
from bench_background import ANCHOR, CASES, LANE_COUNT, ORDER, SCRIPTS

pytestmark = pytest.mark.slow  # every script with the programs it starts


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """{job: (its folder, its exit code or None, why none)}: the lanes started in the
    background as the session began (tests/bench_background.py), or here if nobody had."""
    lanes = bench_background.start(tmp_path_factory.getbasetemp())
    try:
        return bench_background.results(tmp_path_factory.getbasetemp())
    finally:
        bench_background.finish(lanes, stopped=False)


def _finished(bench_runs, name: str) -> tuple[Path, str]:
    """A job's folder and output, once it has exited 0."""
    out, code, problem = bench_runs[name]
    log = (out / "output.log").read_text() if (out / "output.log").exists() else ""
    assert code is not None, f"{name} did not finish: {problem}\n{log[-3000:]}"
    assert code == 0, f"{name} exited {code}\n--- its output\n{log[-6000:]}"
    return out, log


@pytest.mark.parametrize("name", [name for name in ORDER if name != ANCHOR])
def test_benchmark_script_runs(name, bench_runs):
    out, log = _finished(bench_runs, name)
    markdown = (out / f"{name}.md").read_text()
    assert "| " in markdown and "load average" in markdown, log[-2000:]
    data = json.loads((out / f"{name}.json").read_text())
    assert data["tables"] and data["machine"]["cores"] >= 1


def test_the_runs_the_scripts_start_are_forked_from_a_lanes_warm_starter(bench_runs,
                                                                         tmp_path_factory):
    """benchlib.run's `python -m accel_train` and launcher children are forked (the seconds of
    imports they would pay are most of a smoke run's); a lane's starter writes its log when
    it starts (and LOG.refused the runs it had to leave to a new process)."""
    root = bench_background.folder(tmp_path_factory.getbasetemp())
    logs = [root / f"lane{index}.results.starter.log" for index in range(LANE_COUNT)]
    assert any(log.exists() for log in logs), "no lane started its warm starter"


def test_the_lanes_shared_one_list_and_ran_each_job_once(bench_runs, tmp_path_factory):
    """Each job is run by the one lane that claimed it (tests/bench_lane.py): every job of
    ORDER in exactly one lane's results, and that lane's pid in its claim."""
    root = bench_background.folder(tmp_path_factory.getbasetemp())
    ran = [json.loads((root / f"lane{index}.results.json").read_text())
           for index in range(LANE_COUNT)]
    assert sorted(name for lane in ran for name in lane) == sorted(ORDER), ran
    claims = {path.name: path.read_text() for path in (root / "jobs.claims").iterdir()}
    for index, lane in enumerate(ran):
        pid = (root / f"lane{index}.pid").read_text()
        assert {claims[name] for name in lane} <= {pid}, (index, lane, claims)


def test_the_lanes_ran_at_the_lowest_priority_and_this_file_runs_last(bench_runs, request,
                                                                     tmp_path_factory):
    """In the background beside the other tests, the lanes must not slow them: each lane was
    in a cgroup of its own (cpu.idle) or at nice 19.  And this file is the session's last, so
    that the lanes had the other tests' idle moments first."""
    root = bench_background.folder(tmp_path_factory.getbasetemp())
    for index in range(LANE_COUNT):
        priority = json.loads((root / f"lane{index}.results.priority.json").read_text())
        assert ("accel-train-bench-" in priority["cgroup"] or priority["nice"] == 19), priority
    files = [item.nodeid.split("::")[0] for item in request.session.items]
    assert files[-1] == "tests/test_benchmarks.py" and files.index(files[-1]) == \
        len(files) - sum(name == files[-1] for name in files), files[-5:]


def test_every_benchmark_script_is_smoke_tested():
    assert sorted(p.stem[len("bench_"):] for p in SCRIPTS.glob("bench_*.py")) == sorted(CASES)


def test_the_airbench_anchor_trains_and_reports_each_tta_level(bench_runs):
    """benchmarks/anchors/airbench_cpu.py (bench_background.ANCHOR_ARGS: 2 steps an epoch for 4
    epochs, the averaging from the 4th) reports one JSON line with the three TTA levels."""
    _, log = _finished(bench_runs, ANCHOR)
    report = json.loads(log.strip().splitlines()[-1])
    assert report["steps"] == 8 and report["epochs"] == 4.0
    # bf16 only where the CPU has it natively (emulated, it is many times slower than fp32)
    flags = Path("/proc/cpuinfo").read_text().split()
    assert report["precision"] == ("bf16" if {"avx512_bf16", "amx_tile"} & set(flags)
                                   else "fp32"), report
    assert all(0.0 <= report[f"top1_tta{level}"] <= 1.0 for level in (0, 1, 2))
