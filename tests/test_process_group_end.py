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
from pathlib import Path

import pytest

from conftest import TWO_PROCESS_LAUNCHERS, launched_program, run
from tests.fit_threads_probe import GLOO_THREADS

pytestmark = pytest.mark.slow


def _gloo_threads(launcher: str, work: Path, *mode: str) -> dict[str, dict[str, list[str]]]:
    """{when: {rank: the gloo threads its process had then}} for a probe run, when being
    "after-fit" and "at-exit"."""
    result = run(launched_program(launcher, "tests.fit_threads_probe", str(work), *mode),
                 check=True)
    # two ranks: the start summary's words, or each rank's caught error
    assert result.stdout.count("fit raised") == (2 if mode else 0), result.stdout[-3000:]
    assert mode or "x 2 process(es), gloo" in result.stdout, result.stdout[-3000:]
    seen: dict[str, dict[str, list[str]]] = {}
    for when in ("after-fit", "at-exit"):
        for rank in ("0", "1"):
            names = json.loads((work / f"threads-{when}-{rank}.json").read_text())
            seen.setdefault(when, {})[rank] = [name for name in names if name in GLOO_THREADS]
    return seen


@pytest.fixture(scope="module")
def finished_under_torchrun(tmp_path_factory) -> tuple[Path, dict]:
    """A probe run under torchrun left to finish: (its folder, the gloo threads it saw), read
    by the torchrun case below and resumed (and refused) by the last test."""
    work = tmp_path_factory.mktemp("finished")
    return work, _gloo_threads("torchrun", work)


@pytest.mark.parametrize("launcher", TWO_PROCESS_LAUNCHERS)
def test_fit_returns_with_no_gloo_thread_left(launcher, tmp_path, request):
    seen = request.getfixturevalue("finished_under_torchrun")[1] if launcher == "torchrun" \
        else _gloo_threads(launcher, tmp_path)
    assert seen["after-fit"] == {"0": [], "1": []}
    assert seen["at-exit"] == {"0": [], "1": []}


def test_a_run_that_raises_leaves_no_gloo_thread_at_exit(tmp_path):
    """The traceback the program caught holds the run, so its groups outlive `fit`; the exit
    handlers free them."""
    seen = _gloo_threads("torchrun", tmp_path, "fails")
    assert all(seen["after-fit"].values()), seen  # held by the caught error's traceback
    assert seen["at-exit"] == {"0": [], "1": []}


def test_a_start_refused_after_ddp_leaves_no_gloo_thread_at_exit(finished_under_torchrun):
    """Resuming a run with a narrower network is refused after `accelerator.prepare` has built
    DDP, before the trainer exists: its half-built parts hold the default group."""
    seen = _gloo_threads("torchrun", finished_under_torchrun[0], "refused")
    assert all(seen["after-fit"].values()), seen
    assert seen["at-exit"] == {"0": [], "1": []}
