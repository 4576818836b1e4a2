"""The warm starter (tests/warm_start.py) against its oracle, a new process: a run forked from it
must be the process `python -m MODULE` would have been, since most of the suite's
`python -m accel_train` runs are started that way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_TRAIN, WARM
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)
from warm_start import WARM_MODULES, WarmProcess, WarmStarter, forkable

PROBE = "tests.warm_probe"


@pytest.fixture(scope="module")
def starter(tmp_path_factory):
    # (a variable of the starter's own that no run has: a run's environment must be its own)
    warm = WarmStarter(lambda: child_env(ACCEL_TRAIN_STARTER_ONLY="1"), REPO,
                       tmp_path_factory.mktemp("warm") / "starter.log",
                       modules=WARM_MODULES)
    yield warm
    warm.close()


def _probe_fresh(*args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", PROBE, *args], env=env, cwd=cwd,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def _probe_warm(starter, *args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    process = starter.start([sys.executable, "-m", PROBE, *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(process, WarmProcess), "the starter refused a run it should fork"
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_a_forked_run_is_what_a_new_process_would_be(starter):
    env = child_env(ACCEL_TRAIN_SOMETHING="set for this run", RANK="3")
    fresh = _probe_fresh("exit", "7", env=env, cwd=REPO)
    warm = _probe_warm(starter, "exit", "7", env=env, cwd=REPO)
    again = _probe_warm(starter, "exit", "7", env=env, cwd=REPO)
    assert (warm.returncode, fresh.returncode) == (7, 7), warm.stderr + fresh.stderr
    assert warm.stderr == fresh.stderr == "to stderr\n"
    seen, expected, second = (json.loads(result.stdout) for result in (warm, fresh, again))
    for key in ("cwd", "argv", "orig_argv", "path0", "env", "threads", "fds", "main", "stdin",
                "torch_threads", "cmdline", "signals", "wakeup_fd"):
        assert seen[key] == expected[key], key
    assert seen["env"]["ACCEL_TRAIN_SOMETHING"] == "set for this run"
    assert seen["pid"] != second["pid"] and seen["numpy"] != second["numpy"], \
        "two forked runs must not share numpy's seed (a new process draws its own)"
    assert seen["sid"] == expected["sid"] == second["sid"], \
        "a run not asked for a session of its own stays in its caller's"


def _cpu_of_an_empty_run(starter) -> float:
    """What the starter counts for a forked run that does nothing: becoming the run and its
    exit (the copies its writes make of the starter's pages).  That varies with the machine's
    load, so a bound on what else a run may be counted for is this, measured beside it."""
    before = starter.forked_cpu_seconds
    assert starter.run([sys.executable, "-m", PROBE, "exit", "0"], env=child_env(), cwd=REPO,
                       timeout=120).returncode == 0
    return starter.forked_cpu_seconds - before


def test_a_forked_runs_output_reads_line_by_line_as_popens_and_its_cpu_is_counted(starter):
    """start(..., stdout=PIPE, stderr=STDOUT, text=True) as the benchmark scripts stream a
    run (benchlib.start_streaming): `.stdout` yields the run's lines as Popen's would, and the
    run's CPU seconds reach forked_cpu_seconds once it is waited for, as run()'s do.  Oracle:
    the probe's own lines, its own os.times."""
    before = starter.forked_cpu_seconds
    process = starter.start([sys.executable, "-m", PROBE, "burn", "0.2"], env=child_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert isinstance(process, WarmProcess), "the probe must be forked here"
    lines = list(process.stdout)
    assert process.wait(timeout=120) == 0, lines
    seen, counted = json.loads(lines[0]), json.loads(lines[-1])["cpu_seconds"]
    assert seen["preloaded"] and seen["pid"] == process.pid, lines
    assert lines[1:-1] == ["to stderr\n"], lines  # (stderr=STDOUT: the same stream)
    used = starter.forked_cpu_seconds - before
    assert counted <= used <= counted + 2 * _cpu_of_an_empty_run(starter) + 0.3
    process.stdout.close()


def test_the_cpu_seconds_of_a_forked_run_and_what_it_waited_for_reach_the_caller(starter):
    """A forked run is the starter's child, not its caller's: the caller's os.times cannot
    count it, so the starter reports it (the benchmark lanes' CPU figures add it up).  Oracle:
    the run's own os.times, read as it ends (its own and its waited-for child's 0.4 s each)."""
    before = starter.forked_cpu_seconds
    result = starter.run([sys.executable, "-m", PROBE, "burn", "0.4"], env=child_env(), cwd=REPO,
                         timeout=120)
    assert result.returncode == 0, result.stderr
    counted = json.loads(result.stdout.splitlines()[-1])["cpu_seconds"]
    assert counted >= 0.8
    # the rest: the steps of becoming the run, its exit (a new process's imports are not in it)
    used = starter.forked_cpu_seconds - before
    assert counted <= used <= counted + 2 * _cpu_of_an_empty_run(starter) + 0.3


def test_a_forked_run_works_in_the_folder_it_is_given(starter, tmp_path):
    """(The starter's own folder is the repository, where the tests start their runs; a
    module the starter imported stays importable from any folder, unlike in a new process.)"""
    seen = json.loads(_probe_warm(starter, env=child_env(), cwd=tmp_path).stdout)
    assert seen["cwd"] == seen["path0"] == str(tmp_path)


def test_an_exception_ends_the_run_with_1_and_its_traceback(starter):
    warm = _probe_warm(starter, "raise", env=child_env(), cwd=REPO)
    fresh = _probe_fresh("raise", env=child_env(), cwd=REPO)
    assert warm.returncode == fresh.returncode == 1
    assert warm.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == \
        "RuntimeError: the probe's own error"


def test_a_run_in_its_own_session_signalled_and_killed(starter, tmp_path):
    log = (tmp_path / "log").open("w")
    process = starter.popen([sys.executable, "-m", PROBE, "wait"], env=child_env(),
                            cwd=tmp_path, stdin=0, stdout=log.fileno(), stderr=log.fileno(),
                            new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = json.loads((tmp_path / "log").read_text().splitlines()[0])
    assert seen["pid"] == process.pid and seen["sid"] == process.pid
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM  # as subprocess.Popen says it
    assert process.returncode == -signal.SIGTERM
    log.close()


def test_communicate_times_out_as_popens_does(starter):
    """Past its timeout: TimeoutExpired, the run still going, what it wrote kept for the next
    call; killed, the next call ends with the whole output and -9."""
    process = starter.start([sys.executable, "-m", PROBE, "wait"], env=child_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(process, WarmProcess)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with pytest.raises(subprocess.TimeoutExpired):
            process.communicate(timeout=0.5)
        if process._output["stderr"]:  # the probe writes stdout, then stderr, then waits
            break
    assert process.poll() is None
    process.kill()
    out, err = process.communicate(timeout=30)
    assert json.loads(out)["pid"] == process.pid and err == "to stderr\n"
    assert process.returncode == -signal.SIGKILL


def test_a_run_whose_caller_is_gone_is_killed(starter, tmp_path):
    process = starter.popen([sys.executable, "-m", PROBE, "wait"], env=child_env(),
                            cwd=tmp_path, stdin=0, stdout=1, stderr=2)
    process._reply.close()  # what the kernel does when the test process dies
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{process.pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{process.pid}"), "the run outlived its caller"


def test_only_run_time_variables_may_differ_from_the_starters():
    base = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert forkable(dict(base), base)
    assert forkable({**base, "FAULT_STALL_SAVE": "3", "ACCEL_TRAIN_CIFAR10": "/x",
                     "RANK": "1", "WORLD_SIZE": "2", "PYTEST_CURRENT_TEST": "t",
                     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, base)
    for name, value in (("HF_HUB_OFFLINE", "0"), ("OMP_NUM_THREADS", "2"), ("PATH", "/usr"),
                        ("HF_HOME", "/tmp/hf"), ("ACCELERATE_USE_CPU", "1"),
                        ("RANKS", "1"), ("CUDA_VISIBLE_DEVICES", "0"), ("ACCEL_OTHER", "1"),
                        ("MY_FAULT_X", "1"), ("TORCH_ELASTIC_OTHER", "1")):
        assert not forkable({**base, name: value}, base), name
    assert not forkable({k: v for k, v in base.items() if k != "PATH"}, base)


def test_other_commands_get_a_new_process(starter, tmp_path):
    for cmd in ([sys.executable, "-m", "accelerate.commands.env"],
                [sys.executable, "benchmarks/bench_seed.py"], ["python3", "-m", PROBE]):
        assert starter.popen(cmd, env=child_env(), cwd=tmp_path, stdin=0, stdout=1,
                             stderr=2) is None, cmd
    assert starter.popen([sys.executable, "-m", PROBE], env=child_env(HF_HOME=str(tmp_path)),
                         cwd=tmp_path, stdin=0, stdout=1, stderr=2) is None


def test_a_closed_starter_lets_its_runs_finish_and_the_next_run_starts_a_new_one(tmp_path):
    warm = WarmStarter(child_env, REPO, tmp_path / "starter.log", modules=(PROBE,), imports=())
    log = (tmp_path / "log").open("w")
    process = warm.popen([sys.executable, "-m", PROBE, "wait"], env=child_env(), cwd=REPO,
                         stdin=0, stdout=log.fileno(), stderr=log.fileno())
    first = warm._process
    warm.close()
    time.sleep(0.5)
    assert process.poll() is None and first.poll() is None, "a run going must not be stopped"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    first.wait(timeout=30)  # and then the closed starter ends
    assert _probe_warm(warm, "exit", "3", env=child_env(), cwd=REPO).returncode == 3
    assert warm.starts == 2
    warm.close()
    log.close()


def test_a_starter_that_died_is_started_again(tmp_path):
    warm = WarmStarter(child_env, REPO, tmp_path / "starter.log", modules=(PROBE,), imports=())
    assert _probe_warm(warm, "exit", "4", env=child_env(), cwd=REPO).returncode == 4
    warm._process.kill()
    warm._process.wait()
    assert _probe_warm(warm, "exit", "5", env=child_env(), cwd=REPO).returncode == 5
    assert warm.starts == 2
    warm.close()


def test_the_starter_follows_a_baseline_that_moved(tmp_path):
    """A variable the pytest process keeps from then on (as torch's compiler sets
    TORCHINDUCTOR_CACHE_DIR) starts the starter again; one a run sets for itself does not."""
    baseline = child_env()
    warm = WarmStarter(lambda: dict(baseline), REPO, tmp_path / "starter.log",
                       modules=(PROBE,), imports=())
    probe = [sys.executable, "-m", PROBE, "exit", "0"]

    def refused(env: dict) -> bool:
        return warm.popen(probe, env=env, cwd=REPO, stdin=0, stdout=1, stderr=2) is None

    assert _probe_warm(warm, "exit", "0", env=dict(baseline), cwd=REPO).returncode == 0
    assert refused({**baseline, "HF_HOME": str(tmp_path / "hf")})
    assert warm.starts == 1
    baseline["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    moved = json.loads(_probe_warm(warm, env=dict(baseline), cwd=REPO).stdout)
    assert warm.starts == 2 and moved["env"] == baseline
    assert refused(child_env())  # the old baseline, now
    refused = (tmp_path / "starter.log.refused").read_text().splitlines()
    assert len(refused) == 2 and "['HF_HOME']" in refused[0], refused
    assert "['TORCHINDUCTOR_CACHE_DIR']" in refused[1], refused
    warm.close()


def test_a_forked_training_run_ends_bit_identical_to_a_new_process(tmp_path):
    """The suite's own starter, on the command most runs are: the same weights to the bit."""
    command = [*TINY_TRAIN, "--synthetic-train-size", "64", "--max-eval-samples", "16"]
    process = WARM.start([sys.executable, "-m", "accel_train", *command, "--output-dir",
                          str(tmp_path / "warm")], env=child_env(), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if WARM.broken:
        pytest.skip("the warm starter is off (ACCEL_TRAIN_TEST_WARM=0) or failed to start")
    assert isinstance(process, WarmProcess), (
        f"the suite's warm starter refused a plain run: "
        f"{Path(str(WARM.log) + '.refused').read_text()[-2000:]}")
    _, warm_stderr = process.communicate(timeout=300)
    fresh = subprocess.run([sys.executable, "-m", "accel_train", *command, "--output-dir",
                            str(tmp_path / "fresh")], env=child_env(), cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert process.returncode == fresh.returncode == 0, warm_stderr[-3000:] + fresh.stderr[-3000:]
    ours, theirs = (load_file(str(tmp_path / name / "model.safetensors"))
                    for name in ("warm", "fresh"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
