"""One writer per run folder (accel_train/run/runlock.py): a second start on a folder that a live
run holds stops in one line naming the holder's host and pid (exit 2) before it moves or writes
anything; a lock whose holder is gone is taken over; the lock is released at the end of a run, on
bad input and on a stop by signal; the same job's previous holder is waited for."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from accel_train.run import runlock
from accel_train.base.errors import UsageError
from conftest import TINY_TRAIN, accel_train, accel_train_here
from faults import FAULT_TRAIN, Run, python_cmd, wait_for_stall, wait_until

HOST = socket.gethostname()
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """Outside any SLURM or torchelastic job (a CI job's variables would make every start here
    the same job, which waits instead of stopping)."""
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _names(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _write_lock(folder: Path, host: str, pid: int, started=None, job=None, boot="this",
                token="theirs") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.lock"
    path.write_text(json.dumps({"host": host, "pid": pid, "started": started,
                                "boot_id": runlock.boot_id() if boot == "this" else boot,
                                "job": job, "token": token}))
    return path


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow  # two runs at once
def test_a_second_start_stops_in_one_line_and_touches_nothing(tmp_path, runs):
    """The holder is stalled inside the save of step 6 (its .tmp-step_00000006 half written,
    which a resuming start would delete; sealed in line, so that nothing of it moves).  A
    second start, new or --resume auto, in a fresh process: exit 2, one line with the
    holder's host and pid and the folder, every file of the folder byte-identical.  Then the
    holder is killed: its lock is stale, and --resume auto takes it over and continues from
    step 3."""
    out = tmp_path / "run"
    holder = Run(python_cmd(*FAULT_TRAIN, "--output-dir", str(out)), tmp_path / "holder.log",
                 FAULT_STALL_SAVE="6", FAULT_SEAL_IN_LINE="1")
    runs.append(holder)
    wait_for_stall(holder, 6)
    assert (out / "checkpoints" / ".tmp-step_00000006").is_dir() and (out / "run.lock").is_file()
    before = _hashes(out)

    for extra in ([], ["--resume", "auto"]):
        second = accel_train(*FAULT_TRAIN, "--output-dir", str(out), *extra)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert lines[0].startswith(f"accel_train: error: --output-dir {out} is in use by another "
                                   f"run (host {HOST}, pid {holder.proc.pid}, started ")
        assert f"delete {out / 'run.lock'}" in lines[0]
        assert _hashes(out) == before

    holder.kill_all()
    result = accel_train_here(*FAULT_TRAIN, "--output-dir", str(out), "--resume", "auto",
                              check=True)
    assert (f"warning: took over {out / 'run.lock'} from a run that is gone (host {HOST}, pid "
            f"{holder.proc.pid}, started ") in result.stdout
    assert f"process {holder.proc.pid} has exited" in result.stdout
    assert "resumed from" in result.stdout and "step_00000003 at step 3" in result.stdout
    assert not (out / "run.lock").exists() and not list(out.rglob(".tmp-*"))


@pytest.mark.parametrize("how", ["a new run", "--resume auto"])
def test_a_lock_left_by_an_exited_process_is_taken_over(tmp_path, how):
    out = tmp_path / "run"
    if how == "--resume auto":
        accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--output-dir", str(out), check=True)
    pid = _exited_pid()
    _write_lock(out, HOST, pid)
    extra = ["--resume", "auto"] if how == "--resume auto" else []
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "4", "--output-dir", str(out), *extra,
                              check=True)
    assert f"pid {pid}, started at an unknown time): process {pid} has exited" in result.stdout
    assert ("resumed from" in result.stdout) == (how == "--resume auto")
    assert (out / "model.safetensors").is_file() and not (out / "run.lock").exists()


def test_the_lock_is_released_on_bad_input_and_a_new_folder_is_not_left_behind(tmp_path):
    out = tmp_path / "new" / "run"
    result = accel_train_here(*TINY_TRAIN, "--output-dir", str(out), "--resume",
                              str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "no such checkpoint folder" in result.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_stop_by_signal_releases_the_lock(tmp_path, runs):
    out = tmp_path / "run"
    long_run = [*FAULT_TRAIN, "--epochs", "50"]  # the last --epochs counts
    run = Run(python_cmd(*long_run, "--output-dir", str(out)), tmp_path / "run.log")
    runs.append(run)
    wait_until(lambda: (out / "checkpoints" / "step_00000003").is_dir(), "a checkpoint", run)
    assert (out / "run.lock").is_file()
    run.proc.send_signal(signal.SIGTERM)
    assert "stopped by a signal" in run.check(143)
    assert not (out / "run.lock").exists()


# -- the stale rules, on runlock.take itself ----------------------------------------------------

def _sleeper(runs_list: list) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    runs_list.append(proc)
    wait_until(lambda: runlock.process_start_time(proc.pid) is not None, "the sleeper")
    return proc


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def _take(path: Path, job=None) -> tuple[runlock.RunLock, list[str]]:
    said: list[str] = []
    return runlock.take(path, job, said.append), said


def test_a_live_holder_on_this_machine_is_refused(tmp_path, sleepers):
    proc = _sleeper(sleepers)
    path = _write_lock(tmp_path / "run", HOST, proc.pid, runlock.process_start_time(proc.pid))
    before = path.read_bytes()
    with pytest.raises(UsageError) as err:
        _take(path)
    assert f"(host {HOST}, pid {proc.pid}, started " in str(err.value)
    assert f"`ps -p {proc.pid}` on {HOST}" in str(err.value) and path.read_bytes() == before


def test_a_reused_pid_is_not_mistaken_for_the_holder(tmp_path, sleepers):
    proc = _sleeper(sleepers)  # alive, but started long after the lock's holder did
    path = _write_lock(tmp_path / "run", HOST, proc.pid, started=1_000_000.0)
    lock, said = _take(path)
    assert said[0].endswith(f"(host {HOST}, pid {proc.pid}, started {_local(1_000_000.0)}): "
                            f"pid {proc.pid} now belongs to another process")
    lock.release()
    assert not path.exists()


def test_another_machines_lock_is_stale_once_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "WATCH_SECONDS", 1.0)
    monkeypatch.setattr(runlock, "POLL_SECONDS", 0.1)
    path = _write_lock(tmp_path / "run", "elsewhere.example", 4242)
    lock, said = _take(path)
    assert "host elsewhere.example, pid 4242" in said[0] and "heartbeat stopped" in said[0]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_another_machines_lock_that_is_refreshed_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "WATCH_SECONDS", 1.0)
    monkeypatch.setattr(runlock, "POLL_SECONDS", 0.1)
    path = _write_lock(tmp_path / "run", "elsewhere.example", 4242)
    done = threading.Event()

    def heartbeat():  # what the holder's thread does on its machine
        while not done.wait(0.05):
            os.utime(path)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        with pytest.raises(UsageError, match="host elsewhere.example, pid 4242") as err:
            _take(path)
        assert ("(its lock is refreshed every 10 s while it runs, and taken over by a start "
                "that sees no refresh for 1 s; if it is gone, delete ") in str(err.value)
    finally:
        done.set()
        beat.join()
    assert json.loads(path.read_text())["pid"] == 4242


def test_the_same_jobs_previous_holder_is_waited_for(tmp_path, sleepers, monkeypatch):
    """A requeued or restarted start of the same job finds the old holder still exiting: it
    waits for it instead of stopping, and takes the lock once it is gone.  Another job stops
    at once."""
    monkeypatch.setattr(runlock, "POLL_SECONDS", 0.05)
    proc = _sleeper(sleepers)
    path = _write_lock(tmp_path / "run", HOST, proc.pid, runlock.process_start_time(proc.pid),
                       job="SLURM job 42")
    started = time.monotonic()
    with pytest.raises(UsageError, match=f"pid {proc.pid}, started .*, SLURM job 42\\)"):
        _take(path, job="SLURM job 43")
    assert time.monotonic() - started < 5
    threading.Timer(1.0, proc.kill).start()
    lock, said = _take(path, job="SLURM job 42")
    assert time.monotonic() - started >= 1.0 and f"process {proc.pid} has exited" in said[0]
    lock.release()


def test_a_previous_round_of_the_same_elastic_job_on_another_machine_is_taken_over(tmp_path):
    path = _write_lock(tmp_path / "run", "elsewhere.example", 4242, job="torchelastic job r1")
    lock, said = _take(path, job="torchelastic job r1")
    assert said[0].endswith(": a previous round of this elastic job, which its launcher ended")
    lock.release()


def test_a_lock_from_before_this_machine_restarted_is_taken_over(tmp_path, sleepers):
    """The holder's pid runs again after a restart (a live process here, started when the lock
    says): only the boot id, read from /proc, tells that the holder is gone."""
    proc = _sleeper(sleepers)
    path = _write_lock(tmp_path / "run", HOST, proc.pid, runlock.process_start_time(proc.pid),
                       boot="0" * 8 + "-0000-0000-0000-" + "0" * 12)
    lock, said = _take(path)
    assert said == [f"took over {path} from a run that is gone (host {HOST}, pid {proc.pid}, "
                    f"started {_local(runlock.process_start_time(proc.pid))}): this machine "
                    f"has restarted since"]
    lock.release()
    assert not path.exists()


def test_a_lock_with_no_boot_id_is_judged_by_its_pid(tmp_path, sleepers):
    """A record without a boot id (written where /proc has none) is not taken for one of
    another boot: its live holder is refused."""
    proc = _sleeper(sleepers)
    path = _write_lock(tmp_path / "run", HOST, proc.pid, runlock.process_start_time(proc.pid),
                       boot=None)
    with pytest.raises(UsageError, match=f"pid {proc.pid}"):
        _take(path)


def test_this_processs_own_lock_left_by_an_earlier_run_in_it_is_taken_over(tmp_path):
    """A program that calls fit() again after a run that could not release its lock (its
    folder's lock still names this process, which is alive)."""
    path = _write_lock(tmp_path / "run", HOST, os.getpid(), runlock.process_start_time(
        os.getpid()))
    lock, said = _take(path)
    assert said[0].endswith(": it is this process's own, left by an earlier run in it")
    assert json.loads(path.read_text())["token"] == lock.me.token != "theirs"
    lock.release()


def test_a_holder_that_exited_but_was_not_reaped_is_gone(tmp_path):
    """A zombie (its parent has not waited for it) still answers kill(pid, 0): /proc's state
    "Z" says it has finished."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1]
                   .split()[0] == "Z", "the child to exit")
        os.kill(proc.pid, 0)  # the pid still exists
        path = _write_lock(tmp_path / "run", HOST, proc.pid)
        lock, said = _take(path)
        assert said[0].endswith(f": process {proc.pid} has exited")
        lock.release()
    finally:
        proc.wait()


def test_the_holder_refreshes_its_lock_while_it_runs(tmp_path, monkeypatch):
    """The heartbeat that tells another machine the holder lives: the lock file's mtime moves
    on while the lock is held, and no more once it is released."""
    monkeypatch.setattr(runlock, "HEARTBEAT_SECONDS", 0.05)
    lock, _ = _take(tmp_path / "run" / "run.lock")
    os.utime(lock.path, (1_000_000, 1_000_000))
    wait_until(lambda: lock.path.stat().st_mtime > 1_000_000, "a heartbeat")
    lock.release()
    assert not lock.path.parent.exists()  # made for the lock, removed with it
    lock.path.parent.mkdir()
    lock.path.write_text("someone else's")
    os.utime(lock.path, (1_000_000, 1_000_000))
    time.sleep(0.3)
    assert lock.path.stat().st_mtime == 1_000_000


def test_a_lock_replaced_by_another_start_is_not_released(tmp_path):
    """Release removes the lock only while it is this run's (its token): a lock another start
    took over meanwhile, or a file damaged by hand, stays for its owner."""
    lock, _ = _take(tmp_path / "run" / "run.lock")
    _write_lock(tmp_path / "run", HOST, 4242, token="another start's")
    lock.release()
    assert json.loads(lock.path.read_text())["token"] == "another start's"
    lock2, _ = _take(tmp_path / "other" / "run.lock")
    lock2.path.write_text("not a record")
    lock2.release()
    assert lock2.path.read_text() == "not a record"


def test_a_stale_lock_replaced_while_it_was_judged_is_put_back(tmp_path, sleepers, monkeypatch):
    """Two starts find another machine's dead lock; the other start takes it over first, while
    this one still watches the old record.  This start's take-over must not remove the new,
    live lock: it puts it back, and stops naming its holder."""
    monkeypatch.setattr(runlock, "WATCH_SECONDS", 0.5)
    monkeypatch.setattr(runlock, "POLL_SECONDS", 0.1)
    path = _write_lock(tmp_path / "run", "elsewhere.example", 4242)
    first = path.stat().st_mtime
    proc = _sleeper(sleepers)

    def sleep_then_lose_the_race(seconds):
        time.sleep(seconds)
        if json.loads(path.read_text())["pid"] == 4242:  # the other start's take-over
            _write_lock(tmp_path / "run", HOST, proc.pid, runlock.process_start_time(proc.pid),
                        token="the other start's")
            os.utime(path, (first, first))  # as the watch saw it: the judgement stands

    said: list[str] = []
    with pytest.raises(UsageError, match=f"host {HOST}, pid {proc.pid}"):
        runlock.take(path, None, said.append, sleep_then_lose_the_race)
    assert json.loads(path.read_text())["token"] == "the other start's"
    assert [p.name for p in path.parent.iterdir()] == ["run.lock"]  # nothing set aside left


def test_a_stale_lock_replaced_by_one_not_yet_written_is_put_back(tmp_path, monkeypatch):
    """The other start has created its lock file and not yet written its record when this one
    sets the stale lock aside: the empty file is the other start's lock, not the stale record
    (which was read), and stays; this start stops, naming the file."""
    monkeypatch.setattr(runlock, "WATCH_SECONDS", 0.5)
    monkeypatch.setattr(runlock, "POLL_SECONDS", 0.1)
    path = _write_lock(tmp_path / "run", "elsewhere.example", 4242)
    first = path.stat().st_mtime

    def sleep_then_lose_the_race(seconds):
        time.sleep(seconds)
        if path.read_text():
            path.write_text("")  # created (O_EXCL), its record not written yet
            os.utime(path, (first, first))

    with pytest.raises(UsageError, match="cannot be read .*another start may be writing it"):
        runlock.take(path, None, [].append, sleep_then_lose_the_race)
    assert path.read_text() == "" and [p.name for p in path.parent.iterdir()] == ["run.lock"]


def _local(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
