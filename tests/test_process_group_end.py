"""A two-process run frees its process groups before the interpreter finalizes: no gloo thread
is left for it.

Left to finalization, a gloo thread dropping its last collective takes the GIL and ends the
rank with "terminate called without an active exception" (SIGABRT; distributed.teardown says
why).  A run that returns frees them before `fit` returns (a program that goes on keeps no
threads or sockets of it); one that raises, whose traceback still holds it, at the exit
handlers.  The oracle is the kernel's list of the process's threads, under both real
launchers."""

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


def _gloo_threads(launcher: str, tmp_path, *mode: str) -> dict[str, dict[str, list[str]]]:
    """{when: {rank: the gloo threads its process had then}} for a probe run, when being
    "after fit" and "at exit"."""
    cmd = [sys.executable, "-m", *LAUNCHERS[launcher], str(free_port()),
           "-m", "tests.fit_threads_probe", str(tmp_path / "run"), *mode]
    result = run(cmd, check=True)
    assert "x 2 process(es), gloo" in result.stdout, result.stdout[-3000:]  # two ranks trained
    seen: dict[str, dict[str, list[str]]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("threads "):
            when, report = line[len("threads "):].split(":", 1)
            report = json.loads(report)
            seen.setdefault(when, {})[report["rank"]] = [
                name for name in report["threads"] if name in GLOO_THREADS]
    assert {when: sorted(ranks) for when, ranks in seen.items()} == {
        "after fit": ["0", "1"], "at exit": ["0", "1"]}, result.stdout[-3000:]
    assert ("fit raised" in result.stdout) == ("fails" in mode), result.stdout[-3000:]
    return seen


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_fit_returns_with_no_gloo_thread_left(launcher, tmp_path):
    seen = _gloo_threads(launcher, tmp_path)
    assert seen["after fit"] == {"0": [], "1": []}
    assert seen["at exit"] == {"0": [], "1": []}


def test_a_run_that_raises_leaves_no_gloo_thread_at_exit(tmp_path):
    """The traceback the program caught holds the run, so its groups outlive `fit`; the exit
    handlers free them."""
    seen = _gloo_threads("torchrun", tmp_path, "fails")
    assert all(seen["after fit"].values()), seen  # held by the caught error's traceback
    assert seen["at exit"] == {"0": [], "1": []}
