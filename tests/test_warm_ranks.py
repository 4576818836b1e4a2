"""Ranks forked by a warm launcher (tests/warm_ranks.py) against their oracle, the same launch
with its ranks exec'd as new interpreters: each rank must be the process torchrun would have
started, since most of the suite's multi-process runs are started that way."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, WARM
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)
from warm_ranks import RANK_VARIABLES, rank_command, variables_read_at_import
from warm_start import WARM_MODULES, WARM_RANKS_ENV, WarmProcess, WarmStarter

PROBE = "tests.warm_probe"
# Differ between two launches of the same command, forked or not.
PER_LAUNCH = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "MASTER_PORT", WARM_RANKS_ENV}


@pytest.fixture(scope="module")
def starter():
    """The suite's own starter (its baseline is child_env's, and it runs PROBE)."""
    assert PROBE in WARM_MODULES
    return WARM


def _torchrun(starter, *probe_args: str, forked: bool, port: int):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--tee", "3",
               "-m", PROBE, *probe_args]
    process = starter.start(command, env=child_env(**{WARM_RANKS_ENV: "1" if forked else "0"}),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(process, WarmProcess), "the starter refused the launcher"
    out, err = process.communicate(timeout=240)
    return process, out + err


def _seen_by_rank(output: str) -> dict[int, dict]:
    seen = {}
    for rank, line in re.findall(r"^\[default(\d)\]:(\{.*\})$", output, re.MULTILINE):
        seen[int(rank)] = json.loads(line)
    assert sorted(seen) == [0, 1], output[-3000:]
    return seen


def test_a_forked_rank_is_what_torchrun_would_have_started(starter):
    launcher, output = _torchrun(starter, "exit", "0", forked=True, port=29611)
    fresh_launcher, fresh_output = _torchrun(starter, "exit", "0", forked=False, port=29612)
    assert launcher.returncode == fresh_launcher.returncode == 0, output[-3000:]
    forked, fresh = _seen_by_rank(output), _seen_by_rank(fresh_output)
    for rank in (0, 1):
        ours, theirs = forked[rank], fresh[rank]
        assert ours["preloaded"] and not theirs["preloaded"], "forked, and exec'd, as asked"
        assert ours["ppid"] == launcher.pid and theirs["ppid"] == fresh_launcher.pid, \
            "the launcher's own child"
        assert ours["sid"] == ours["pid"] and theirs["sid"] == theirs["pid"], \
            "a session of its own (torchrun's start_new_session)"
        assert ours["proc_rank"] == theirs["proc_rank"] == str(rank), \
            "/proc/PID/environ, where the tests find a launcher's ranks"
        for key in ("cwd", "argv", "orig_argv", "path0", "threads", "main", "stdin",
                    "torch_threads", "signals", "wakeup_fd", "fork_keeps_descriptors"):
            assert ours[key] == theirs[key], (rank, key)
        assert ours["cmdline"] == theirs["cmdline"] == [
            sys.executable, "-u", "-m", PROBE, "exit", "0"]
        assert ({k: v for k, v in ours["env"].items() if k not in PER_LAUNCH}
                == {k: v for k, v in theirs["env"].items() if k not in PER_LAUNCH})
        assert ours["env"]["RANK"] == str(rank) and ours["env"][WARM_RANKS_ENV] == "1"
        # The only descriptors a forked rank has beyond a new one's: the pipe libuv's fork
        # handler opens in every child of the launcher (warm_ranks._open_files).
        extra = set(ours["fds"]) - set(theirs["fds"])
        assert set(theirs["fds"]) <= set(ours["fds"]) and len(extra) <= 2, (ours, theirs)
        assert all(ours["fd_kinds"][str(fd)] == "pipe" for fd in extra), ours["fd_kinds"]
    assert forked[0]["numpy"] != forked[1]["numpy"], \
        "two ranks forked from one launcher must not share numpy's seed (new processes do not)"


def test_a_forked_ranks_exit_code_and_traceback_reach_torchrun(starter):
    launcher, output = _torchrun(starter, "exit", "3", forked=True, port=29613)
    assert launcher.returncode == 1, output[-3000:]
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert re.search(r"exitcode\s*:\s*3 ", root_cause), output[-3000:]
    launcher, output = _torchrun(starter, "raise", forked=True, port=29614)
    assert launcher.returncode == 1
    assert "[default0]:RuntimeError: the probe's own error" in output, output[-3000:]
    assert "[default0]:to stderr" in output  # a -u rank's streams: nothing lost at its exit


def test_a_rank_whose_environment_differs_in_a_variable_read_at_import_is_exec_d(tmp_path):
    """torchrun sets OMP_NUM_THREADS (read as torch is imported) for its ranks where its own
    environment has none: its ranks are then new processes, and the refusal is noted."""
    def without_threads() -> dict:
        return {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}

    warm = WarmStarter(without_threads, REPO, tmp_path / "starter.log",
                       modules=WARM_MODULES)
    try:
        process = warm.start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-addr", "127.0.0.1", "--master-port", "29615",
                              "--tee", "3", "-m", PROBE, "exit", "0"], env=without_threads(),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert isinstance(process, WarmProcess), "the starter refused the launcher"
        out, err = process.communicate(timeout=240)
    finally:
        warm.close()
    assert process.returncode == 0, (out + err)[-3000:]
    for rank, seen in _seen_by_rank(out + err).items():
        assert not seen["preloaded"] and seen["env"]["OMP_NUM_THREADS"] == "1", rank
    refused = (tmp_path / "starter.log.refused").read_text().splitlines()
    assert len(refused) == 2 and all("['OMP_NUM_THREADS']" in line for line in refused), refused


def test_only_python_dash_m_of_a_rank_module_is_forked():
    python = sys.executable
    assert rank_command([python, "-u", "-m", "accel_train", "--epochs", "1"],
                        ("accel_train",)) == ("accel_train", ["--epochs", "1"], True)
    assert rank_command([python, "-m", "tests.fault_entry"], ("tests.fault_entry",)) == (
        "tests.fault_entry", [], False)
    for command in ([python, "-u", "train.py"], ["python3", "-u", "-m", "accel_train"],
                    [python, "-u", "-m", "other"], [python, "-X", "dev", "-m", "accel_train"],
                    [python, "-u", "-m"], []):
        assert rank_command(command, ("accel_train",)) is None, command


def test_a_rank_whose_imports_would_read_another_environment_is_exec_d():
    launcher = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "HF_HUB_OFFLINE": "1"}
    ranks_own = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0",
                 "ROLE_RANK": "1", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "2",
                 "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_PORT": "1", "NCCL_P2P_DISABLE": "1",
                 "ACCELERATE_MIXED_PRECISION": "no", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert variables_read_at_import({**launcher, **ranks_own}, launcher) == []
    for name in ("OMP_NUM_THREADS", "PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "MKL_X"):
        assert variables_read_at_import({**launcher, name: "2"}, launcher) == [name]
    assert variables_read_at_import({"PATH": "/bin"}, launcher) == ["HF_HUB_OFFLINE",
                                                                    "OMP_NUM_THREADS"]
    assert not RANK_VARIABLES.fullmatch("RANKS")
    kmp = {**launcher, "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
    assert variables_read_at_import(kmp, launcher, intel_openmp=False) == []
    assert variables_read_at_import(kmp, launcher, intel_openmp=True) == ["KMP_AFFINITY",
                                                                         "KMP_BLOCKTIME"]
