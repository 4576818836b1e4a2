"""A program may call `fit` again in the same processes (a sweep), under a launcher too: the
second run starts its own process group and trains as it would alone, and `mixed_precision`
left to auto keeps the precision Accelerate already holds.

What each guards against: on the launcher's store the second run's gloo group would read the
first one's peer addresses (and fail on "Connection refused", or hang); and auto would time
the second network anew and could choose another precision than the one Accelerate holds,
which Accelerate refuses to switch to.  The oracle for the first is the same run made alone by
a new program under the same launcher: the sweep's second run ends with the same weights, bit
for bit."""

from __future__ import annotations

import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import TWO_PROCESS_LAUNCHERS, launched_program, run

pytestmark = pytest.mark.slow

def _sweep(launcher: str, work: Path, runs: str, *mode: str) -> str:
    """`launcher` "": the program alone, one process."""
    args = (str(work), runs, *mode)
    cmd = (launched_program(launcher, "tests.fit_sweep_probe", *args) if launcher
           else [sys.executable, "-m", "tests.fit_sweep_probe", *args])
    return run(cmd, check=True).stdout


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """alone(launcher): the weights of the oracle, the 0.01 run made alone by a new program
    under `launcher`, made once for the tests that compare a sweep's run with it."""
    made: dict[str, dict] = {}

    def weights(launcher: str) -> dict:
        if launcher not in made:
            work = tmp_path_factory.mktemp("alone")
            _sweep(launcher, work, "0.01/no")
            made[launcher] = load_file(work / "run-0.01" / "model.safetensors")
        return made[launcher]
    return weights


@pytest.mark.parametrize("launcher", TWO_PROCESS_LAUNCHERS)
def test_a_second_fit_under_a_launcher_trains_as_it_would_alone(launcher, tmp_path, alone):
    # the precision pinned: auto could time the lone run into another one
    out = _sweep(launcher, tmp_path / "sweep", "0.1/no,0.01/no")
    assert out.count("x 2 process(es), gloo") == 2, out[-3000:]  # both runs on both ranks
    second = load_file(tmp_path / "sweep" / "run-0.01" / "model.safetensors")
    made_alone = alone(launcher)
    first = load_file(tmp_path / "sweep" / "run-0.1" / "model.safetensors")
    assert second.keys() == made_alone.keys()
    for name in made_alone:
        assert second[name].equal(made_alone[name]), name
    assert any(not first[name].equal(made_alone[name]) for name in made_alone)  # they differ


def test_a_program_keeps_its_own_process_group_through_a_sweep(tmp_path, alone):
    """A torchrun script that starts the default group itself goes on using it after fit():
    the runs destroy only their own control group, and give the program's group torch's
    default timeout back: the first and the last run fail at a step run under a 3-s timeout
    (the program catches it), and rank 1 then comes 6 s late to the program's reduction; the
    run between them trains as it would alone."""
    out = _sweep("torchrun", tmp_path / "sweep", "0.1/no/fails,0.01/no,0.001/no/fails",
                 "own-group")
    assert out.count("run failed") == 4, out[-3000:]  # two runs, two ranks
    assert out.count("after the sweep: all_reduce 3.0") == 2, out[-3000:]
    # the runs' control groups gone with their threads, the program's own still there
    threads = re.findall(r"gloo threads: (\d+) -> (\d+)", out)
    assert len(threads) == 2 and all(before == after != "0" for before, after in threads), out
    second = load_file(tmp_path / "sweep" / "run-0.01" / "model.safetensors")
    made_alone = alone("torchrun")
    for name in made_alone:
        assert second[name].equal(made_alone[name]), name


@pytest.mark.parametrize("first", ["no", "bf16"])
def test_auto_keeps_the_precision_the_first_run_trained_in(first, tmp_path):
    """Each order fails without the mend on one kind of CPU: after fp32 where the CPU has
    native bf16 (the probe's network runs about three times as fast in bf16 there), after bf16
    where it has none (auto is fp32 there without timing)."""
    out = _sweep("", tmp_path, f"0.1/{first},0.01")
    resolved = yaml.safe_load((tmp_path / "run-0.01" / "config.yaml").read_text())["resolved"]
    named = "fp32" if first == "no" else first
    assert (resolved["precision_requested"], resolved["precision_used"]) == ("auto", named)
    assert f"precision {named}" in out and \
        f"{named}: the precision this process trained in before" in out, out[-3000:]


@pytest.mark.parametrize("backend, minutes", [("nccl", 10), ("gloo", 30)])
def test_the_timeout_given_back_is_torchs_documented_default(backend, minutes):
    """init_process_group's documentation: 10 minutes for NCCL, 30 for the other backends."""
    from accel_train.run.distributed import torch_default_timeout
    assert torch_default_timeout(backend) == timedelta(minutes=minutes)
