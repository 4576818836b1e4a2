"""A read stuck on a file (a dead network mount, a disk that stopped answering) is named, and
the process that waits for it stops instead of hanging silently.

The process waiting only sees that nothing comes; the reader knows what it was reading.  Each
reader keeps a note of what it is reading and since when (`reading`, a module global: one per
process; read_value notes each file it opens, iter_shard each sample of a shard, the folder
walks each folder they list, a loader worker each batch), and a watch thread reads the note:

* in a loader worker (`start_watch`, from the loader's worker_init_fn), the watch says on
  stderr, once per stuck read, which file it has been reading and for how long, with the
  worker's Python stack, shortly before the process waiting for it gives up (the DataLoader's
  timeout: --loader-timeout);
* in a process that reads images itself (`stop_when_a_read_sticks`: the train command's own
  reads, the in-memory decoding at the start or --num-workers 0; eval, check-data, shard), the
  watch ends the process in one line naming the file once the read has taken the timeout.  It
  has to end it: a read blocked in the kernel cannot be interrupted from Python, so nothing
  else would.  Only the command line installs it, never the Python API (a program's own process
  is not ours to end).

A note costs about a microsecond per read.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Optional

from accel_train.base.errors import STALLED_EXIT

SAY_AT = 0.8  # of the loader timeout: the worker speaks before the training process stops
_reading: Optional[tuple[Callable[[], str], float]] = None  # (what, since) in this process
_undo_before_a_stop: list[Callable[[], None]] = []  # undone_on_a_stop's, innermost last


class reading:  # lower case: used as a function is, `with reading(...)`
    """Around a read of image files: `describe()` names them (called only if it gets stuck).
    Notes nest (a file read inside a batch's read): the innermost is the one watched, and the
    outer one is watched again once it ends.  A class, not contextlib's generator: a few
    microseconds less per file, which counts beside a small PNG's read."""

    __slots__ = ("describe", "outer")

    def __init__(self, describe: Callable[[], str]):
        self.describe = describe

    def __enter__(self) -> None:
        global _reading
        self.outer = _reading
        _reading = (self.describe, time.monotonic())

    def __exit__(self, *exc) -> None:
        global _reading
        _reading = self.outer


def _watch(name: str, every: float, after: float, act: Callable[[str, float], None],
           done: Optional[threading.Event] = None) -> threading.Thread:
    """A daemon thread calling `act(what, seconds)` once for each note older than `after`
    seconds, looking every `every` seconds, until `done` is set."""
    done = done or threading.Event()

    def watch():
        acted_on = None
        while not done.wait(every):
            note = _reading
            if note is None or note is acted_on:
                continue
            describe, since = note
            stuck = time.monotonic() - since
            if stuck >= after:
                acted_on = note
                act(describe(), stuck)

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def start_watch(worker: str, timeout: float) -> None:
    """In a worker process ("loader worker 3"): a daemon thread that names a read stuck for
    SAY_AT x `timeout`."""
    if timeout <= 0:
        return

    def say(what: str, stuck: float) -> None:
        print(f"accel_train: {worker} (pid {os.getpid()}) has been reading {what} for "
              f"{stuck:.0f} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    _watch("accel_train-loader-watch", min(1.0, timeout / 10), SAY_AT * timeout, say)


@contextlib.contextmanager
def stop_when_a_read_sticks(timeout: float, stop_line: Callable[[str, float], str]):
    """Within: in a command-line process that reads images itself, once a read noted with
    `reading` has taken `timeout` seconds, print `stop_line(what, seconds)` on stderr and end
    the process with exit code 75 (sysexits' EX_TEMPFAIL).  0 waits for ever.  The watch's
    thread ends with the `with` (a process then exits, or goes on, without it: a thread still
    running as the interpreter exits is one more thing for its shutdown to meet)."""
    if timeout <= 0:
        yield
        return

    def stop(what: str, stuck: float) -> None:
        sys.stdout.flush()
        print(stop_line(what, stuck), file=sys.stderr, flush=True)
        for undo in reversed(_undo_before_a_stop):
            with contextlib.suppress(OSError):
                undo()
        os._exit(STALLED_EXIT)  # the main thread sits in the read: no exception reaches it

    done = threading.Event()
    thread = _watch("accel_train-read-watch", min(1.0, timeout / 10), timeout, stop, done)
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def undone_on_a_stop(undo: Callable[[], None]):
    """Within: `undo` runs before a stuck read ends the process (stop_when_a_read_sticks),
    whose os._exit skips every `finally` and `with` exit: a half-written output removed there
    would otherwise stay."""
    _undo_before_a_stop.append(undo)
    try:
        yield
    finally:
        _undo_before_a_stop.remove(undo)


def read_stuck_line(what: str, seconds: float, flag: str, where: str, then: str) -> str:
    """The one line of a stop by stop_when_a_read_sticks."""
    return (f"reading {what} has taken {seconds:.0f} s ({flag}), {where}: the file system does "
            f"not answer (a network mount that went away?); exit {STALLED_EXIT}, {then}")
