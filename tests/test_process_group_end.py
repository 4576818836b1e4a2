"""A two-process run that returns has freed its process groups: no gloo thread outlives it.

A program that trains and goes on would otherwise keep each group's threads and sockets, and
every process kept them until the interpreter finalized, where a gloo thread dropping its last
collective takes the GIL and ends the rank with "terminate called without an active
exception" (SIGABRT; distributed.teardown says why).  The oracle is the kernel's list of the
process's threads, read after `accel_train.fit` returned, under both real launchers."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import CONFIGS, free_port, run

pytestmark = pytest.mark.slow

LAUNCHERS = {
    "torchrun": ["torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port"],
    "accelerate launch": ["accelerate.commands.launch", "--config_file",
                          str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port"],
}
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_fit_returns_with_no_gloo_thread_left(launcher, tmp_path):
    cmd = [sys.executable, "-m", *LAUNCHERS[launcher], str(free_port()),
           "-m", "tests.fit_threads_probe", str(tmp_path / "run")]
    result = run(cmd, check=True)
    assert "x 2 process(es), gloo" in result.stdout, result.stdout[-3000:]  # two ranks trained
    reports = [json.loads(line.split(":", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("threads after fit:")]
    assert sorted(report["rank"] for report in reports) == ["0", "1"], result.stdout[-3000:]
    for report in reports:
        assert not [name for name in report["threads"] if name in GLOO_THREADS], report
