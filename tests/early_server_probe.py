"""What the loader workers' server forked early (worker_start.start_server_now) looks like from
outside, in a process of its own: `python -m tests.early_server_probe` prints one JSON line that
tests/test_loader_workers.py checks.  Each case needs a process that has never had a server, so
they run in turn, each stopping its server before the next.

Before the first fork the process does what a training process has done by then: it opened a
file, handles SIGTERM in Python and registered the stack dump on SIGUSR1 (cli.main)."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import sys
import tempfile
import threading
from multiprocessing import forkserver

import psutil
from torch.utils.data import Dataset

from accel_train.data import worker_start
from accel_train.data.loaders import make_loader
from accel_train.base.errors import stacks_on_request


class ParentOfEach(Dataset):
    """Item i: (i, the pid of the process that read it, that process's parent)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> list[int]:
        gc.collect()  # what a worker's collector would do some time: see Finalized
        return [index, os.getpid(), os.getppid()]


class Finalized:
    """Garbage that only a collection frees (a reference cycle) whose finalizer notes the pid
    of the process that ran it: garbage that holds a file closes it that way, and in the server
    or a worker it forked, a descriptor number the process has reused since."""

    def __init__(self, log: str):
        self.log, self.cycle = log, self

    def __del__(self):
        with open(self.log, "a") as note:
            note.write(f"{os.getpid()}\n")


def signal_bits(pid: int, field: str) -> list[int]:
    """The signals set in /proc/PID/status's mask FIELD (SigBlk, SigCgt, SigIgn)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            mask = int(line.split()[1], 16)
            return [sig for sig in range(1, 65) if mask >> (sig - 1) & 1]
    raise KeyError(field)


def server_pid():
    return forkserver._forkserver._forkserver_pid


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def read_through_workers() -> list[tuple[int, int, int]]:
    """Every item of ParentOfEach, read by a loader with two workers."""
    loader = make_loader(ParentOfEach(), batch_size=2, num_workers=2, prefetch_factor=2,
                         persistent_workers=False, pin_memory=False, timeout=60)
    return [row for batch in loader for row in zip(*(column.tolist() for column in batch))]


def main() -> dict:
    seen = {}
    # Held open across the fork, above the standard streams (a process started without stdin
    # would hand a new file descriptor 0, which any server keeps).
    opened = fcntl.fcntl(os.open(__file__, os.O_RDONLY), fcntl.F_DUPFD, 10)
    signal.signal(signal.SIGTERM, lambda *_: None)
    stacks_on_request()

    # 1. Forked early, then asked for workers by a loader; garbage left from before the fork
    # (the collector off until then, so that it is still there) is freed by this process's
    # collector only, never by the server's or its workers'.
    finalized_log = tempfile.mkstemp()[1]
    gc.disable()
    Finalized(finalized_log)
    seen["started"] = worker_start.start_server_now()
    gc.enable()
    pid = server_pid()
    server = psutil.Process(pid)
    seen["server_parent_is_us"] = server.ppid() == os.getpid()
    rows = read_through_workers()  # first: the server has then made itself a server
    seen["server_cmdline_is_ours"] = server.cmdline() == psutil.Process().cmdline()
    seen["server_files"] = [[f.path, f.fd] for f in server.open_files()]
    seen["our_file"] = [__file__, opened]
    seen["server_blocked"] = signal_bits(pid, "SigBlk")
    seen["server_caught"] = signal_bits(pid, "SigCgt")
    seen["server_group_is_ours"] = os.getpgid(pid) == os.getpgid(0)
    seen["items"] = sorted(row[0] for row in rows)
    seen["workers_parents"] = sorted({row[2] for row in rows})
    seen["workers"] = len({row[1] for row in rows})
    seen["server_pid"] = pid
    gc.collect()
    seen["finalized_in"] = [int(line) for line in open(finalized_log).read().split()]
    seen["pid"] = os.getpid()
    seen["again_while_running"] = worker_start.start_server_now()
    seen["same_server"] = server_pid() == pid
    worker_start.stop_unused_server()
    seen["asked_server_kept"] = server_pid() == pid and not gone(pid)
    worker_start.stop_unused_server(asked_or_not=True)
    seen["stopped_when_told"] = gone(pid)

    # 2. Forked early and never asked: stopped.  The process keeps one new descriptor, the
    # write end of the pipe whose end tells the server to go.
    before = len(os.listdir("/proc/self/fd"))
    seen["second_started"] = worker_start.start_server_now()
    seen["new_descriptors"] = len(os.listdir("/proc/self/fd")) - before
    pid = server_pid()
    worker_start.stop_unused_server()
    seen["unasked_stopped"] = gone(pid) and server_pid() is None

    # 3. A module the server would preload imported after the fork: replaced by the usual one.
    seen["third_started"] = worker_start.start_server_now()
    pid = server_pid()
    import datasets  # noqa: F401  (worker_start.PRELOAD_IF_IMPORTED)

    seen["replacement_parents"] = sorted({row[2] for row in read_through_workers()})
    seen["replaced"] = gone(pid) and server_pid() not in (None, pid)
    seen["replacement_cmdline"] = psutil.Process(server_pid()).cmdline()
    seen["replacement_pid"] = server_pid()
    worker_start.stop_unused_server(asked_or_not=True)
    forkserver._forkserver._stop()

    # 4. Forked with that module imported (a run that reads its data with it): kept.
    seen["fourth_started"] = worker_start.start_server_now(also=["datasets"])
    pid = server_pid()
    seen["fourth_parents"] = sorted({row[2] for row in read_through_workers()})
    seen["fourth_kept"] = server_pid() == pid and not gone(pid)
    seen["fourth_pid"] = pid
    worker_start.stop_unused_server(asked_or_not=True)

    # 5. Another thread running: no fork.
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    seen["with_a_thread"] = worker_start.start_server_now()
    seen["with_a_thread_server"] = server_pid()
    stop.set()
    other.join()
    return seen


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
