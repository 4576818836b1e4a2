"""A loader worker stuck reading a file (a dead network mount, a disk that stopped answering)
names that file itself.

The training process only sees that no batch comes: the DataLoader's own timeout
(--loader-timeout) ends the wait with "DataLoader timed out", which says nothing of why.  The
worker knows what it was reading.  Each worker keeps a note of the images it is decoding and
since when (`reading`, a module global: one per worker process), and a watch thread in it
(`start_watch`, from the loader's worker_init_fn) says on stderr, once per stuck read, which
file it has been reading and for how long, with the worker's Python stack, shortly before the
training process gives up.  The note costs two assignments per batch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Optional

SAY_AT = 0.8  # of the loader timeout: the worker speaks before the training process stops
_reading: Optional[tuple[Callable[[], str], float]] = None  # (what, since) in this worker


@contextlib.contextmanager
def reading(describe: Callable[[], str]):
    """Around a read of image files: `describe()` names them (called only if it gets stuck)."""
    global _reading
    _reading = (describe, time.monotonic())
    try:
        yield
    finally:
        _reading = None


def start_watch(worker_id: int, timeout: float) -> None:
    """In a loader worker: a daemon thread that names a read stuck for SAY_AT x `timeout`."""
    if timeout <= 0:
        return

    def watch():
        said_for = None
        while True:
            time.sleep(min(1.0, timeout / 10))
            note = _reading
            if note is None or note is said_for:
                continue
            describe, since = note
            stuck = time.monotonic() - since
            if stuck >= SAY_AT * timeout:
                said_for = note
                print(f"accel_train: loader worker {worker_id} (pid {os.getpid()}) has been "
                      f"reading {describe()} for {stuck:.0f} s", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    threading.Thread(target=watch, name="accel_train-loader-watch", daemon=True).start()
