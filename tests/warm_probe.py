"""`python -m tests.warm_probe [raise|exit N|wait|burn SECONDS]`: prints what a process knows of
itself, as one JSON line, for tests/test_warm_start.py to compare a forked run with a new
process.  `burn`: a child it waits for, then the probe itself, each use SECONDS of CPU; a second
line gives the CPU seconds the probe counted for itself and the child (os.times) as it ends."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time

# (timm is imported by a warm starter, never by this probe: True in a forked run)
PRELOADED = "timm" in sys.modules


def _open_descriptors() -> dict[int, str]:
    """Descriptor -> "pipe" or "other", found without opening one (as listing /proc would)."""
    found = {}
    for fd in range(256):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        found[fd] = "pipe" if stat.S_ISFIFO(mode) else "other"
    return found


def _a_fork_keeps_descriptors() -> bool:
    """Whether a child forked now still has the descriptors this process opens as they were (a
    fork handler of a library may close numbers it thinks are its own).  Every free number up
    to 64 is taken by a pipe first, so that a number such a handler closes is one of these."""
    opened: list[int] = []
    while not opened or max(opened) < 64:
        opened.extend(os.pipe())
    files = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in opened}
    pid = os.fork()
    if pid == 0:
        try:
            same = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in files} == files
        except OSError:
            same = False
        os._exit(0 if same else 1)
    _, status = os.waitpid(pid, 0)
    for fd in opened:
        os.close(fd)
    return os.waitstatus_to_exitcode(status) == 0


def _cpu_seconds(children: bool) -> float:
    used = os.times()
    return used.user + used.system + (used.children_user + used.children_system) * children


def _burn(seconds: float) -> None:
    until = _cpu_seconds(children=False) + seconds
    while _cpu_seconds(children=False) < until:
        pass


if __name__ == "__main__":
    import numpy
    import psutil

    descriptors = _open_descriptors()
    fork_keeps_descriptors = _a_fork_keeps_descriptors()
    print(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "preloaded": PRELOADED,
        "proc_rank": psutil.Process().environ().get("RANK"),
        "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:], "path0": sys.path[0], "env": dict(os.environ),
        "threads": threading.active_count(), "fds": sorted(descriptors),
        "fd_kinds": descriptors, "fork_keeps_descriptors": fork_keeps_descriptors,
        "numpy": int(numpy.random.randint(1 << 30)),
        "main": sys.modules["__main__"].__spec__.name, "stdin": sys.stdin.read(),
        "torch_threads": __import__("torch").get_num_threads(),
        # (a forked run's line is followed by empty arguments: warm_start._show_command_line)
        "cmdline": [part for part in psutil.Process().cmdline() if part],
        "signals": {name: str(signal.getsignal(getattr(signal, name)))
                    for name in ("SIGCHLD", "SIGTERM", "SIGINT", "SIGPIPE", "SIGUSR1")},
        "wakeup_fd": signal.set_wakeup_fd(-1)}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1:2] == ["raise"]:
        raise RuntimeError("the probe's own error")
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
    if sys.argv[1:2] == ["wait"]:
        time.sleep(600)
    if sys.argv[1:2] == ["burn"]:
        child = os.fork()
        if child == 0:
            _burn(float(sys.argv[2]))
            os._exit(0)
        os.waitpid(child, 0)
        _burn(float(sys.argv[2]))
        print(json.dumps({"cpu_seconds": _cpu_seconds(children=True)}), flush=True)
