"""A pytest plugin that records each test's CPU seconds, for finding where the suite's time goes
(docs/development.md, "How long the suite takes"): opt-in, nothing in the suite loads it.

    ACCEL_TRAIN_CPU_REPORT=cpu.jsonl scripts/with_env python -m pytest -p tests.cpu_per_test

One JSON line per test: the xdist worker that ran it and when it started (for the workers'
timelines: where one sits idle at the end), its wall seconds, the CPU seconds of the pytest
process that ran it ("self") and of the child processes it started and waited for ("children":
launchers, ranks, fresh training processes; a module fixture's runs count for the test that first
used it).
Processes nobody waits for (a loader workers' fork server, an orphaned grandchild) are not in
"children"; "tree" counts them: where cgroup v1's `cpuacct` controller can be written (root),
each pytest worker moves itself into a cgroup of its own as it starts, every process it starts
stays in it whatever its session, and "tree" is that cgroup's CPU seconds during the test.
Linux process accounting (`accton`, Debian's acct) sees every process too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

REPORT_ENV = "ACCEL_TRAIN_CPU_REPORT"
ACCOUNTING = Path("/sys/fs/cgroup/cpuacct")
_group: Path | None = None


def pytest_configure(config):
    global _group
    group = ACCOUNTING / f"accel-train-cpu-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        _group = group
    except OSError:
        _group = None


def pytest_unconfigure(config):
    if _group is not None:
        try:  # back to the root group; the group goes once nothing is left in it
            (ACCOUNTING / "cgroup.procs").write_text(str(os.getpid()))
            _group.rmdir()
        except OSError:
            pass


def _tree_seconds() -> float | None:
    return None if _group is None else int((_group / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started, clock = os.times(), time.monotonic(), time.time()
    tree = _tree_seconds()
    yield
    after = os.times()
    if tree is not None:
        tree = round(_tree_seconds() - tree, 3)
    record = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
              "start": round(clock, 3), "wall": round(time.monotonic() - started, 3),
              "self": round(after.user - before.user + after.system - before.system, 3),
              "children": round(after.children_user - before.children_user
                                + after.children_system - before.children_system, 3),
              "tree": tree}
    with open(os.environ.get(REPORT_ENV, "cpu_per_test.jsonl"), "a") as report:
        report.write(json.dumps(record) + "\n")
