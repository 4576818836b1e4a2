"""A program may call `fit` again in the same processes under a launcher (a sweep): the second
run starts its own process group and trains as it would alone.

Its first version failed: the second run's gloo group read the first one's peer addresses
from the launcher's store and gave up on "Connection refused".  The oracle is the same run
made alone by a new program under the same launcher: the sweep's second run ends with the same
weights, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import CONFIGS, free_port, run

pytestmark = pytest.mark.slow

LAUNCHERS = {
    "torchrun": ["torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port"],
    "accelerate launch": ["accelerate.commands.launch", "--config_file",
                          str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port"],
}


def _sweep(launcher: str, work: Path, learning_rates: str) -> str:
    cmd = [sys.executable, "-m", *LAUNCHERS[launcher], str(free_port()),
           "-m", "tests.fit_sweep_probe", str(work), learning_rates]
    return run(cmd, check=True).stdout


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_second_fit_under_a_launcher_trains_as_it_would_alone(launcher, tmp_path):
    out = _sweep(launcher, tmp_path / "sweep", "0.1,0.01")
    assert out.count("x 2 process(es), gloo") == 2, out[-3000:]  # both runs on both ranks
    _sweep(launcher, tmp_path / "alone", "0.01")
    second = load_file(tmp_path / "sweep" / "run-0.01" / "model.safetensors")
    alone = load_file(tmp_path / "alone" / "run-0.01" / "model.safetensors")
    first = load_file(tmp_path / "sweep" / "run-0.1" / "model.safetensors")
    assert second.keys() == alone.keys()
    for name in alone:
        assert second[name].equal(alone[name]), name
    assert any(not first[name].equal(alone[name]) for name in alone)  # the runs differ
