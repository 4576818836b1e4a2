"""A pytest plugin that records each test's CPU seconds, for finding where the suite's time goes
(docs/development.md, "How long the suite takes"): opt-in, nothing in the suite loads it.

    ACCEL_TRAIN_CPU_REPORT=cpu.jsonl scripts/with_env python -m pytest -p tests.cpu_per_test

One JSON line per test: the xdist worker that ran it and when it started (for the workers'
timelines: where one sits idle at the end), its wall seconds, the CPU seconds of the pytest
process that ran it ("self") and of the child processes it started and waited for ("children":
launchers, ranks, fresh training processes; a module fixture's runs count for the test that first
used it).
Processes nobody waits for (a fork server, an orphaned grandchild) are not counted: Linux process
accounting (`accton`, Debian's acct) sees those.
"""

from __future__ import annotations

import json
import os
import time

import pytest

REPORT_ENV = "ACCEL_TRAIN_CPU_REPORT"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started, clock = os.times(), time.monotonic(), time.time()
    yield
    after = os.times()
    record = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
              "start": round(clock, 3), "wall": round(time.monotonic() - started, 3),
              "self": round(after.user - before.user + after.system - before.system, 3),
              "children": round(after.children_user - before.children_user
                                + after.children_system - before.children_system, 3)}
    with open(os.environ.get(REPORT_ENV, "cpu_per_test.jsonl"), "a") as report:
        report.write(json.dumps(record) + "\n")
