"""Telling a loader worker's death from other loader errors, whichever way torch reports it, and
letting the training process find it at a batch rather than wherever a signal lands.

torch reports a dead worker as a RuntimeError ("DataLoader worker (pid(s) N) exited
unexpectedly", or "... is killed by signal") when it sees the death itself.  It misses one case:
a worker killed while the main process is taking a batch from it.  A batch's tensors come over
a socket from the worker that made them (torch's file-descriptor sharing); the kill resets that
socket, and torch's own check that follows asks the workers whether they live before the fork
server has reported the death, finds them all alive and re-raises the bare socket error
(ConnectionResetError inside `rebuild_storage_fd`; seen in CI).  `dead_loader_worker` covers
both: torch's words, or a socket error raised inside a loader iterator one of whose workers is
found dead within a few seconds.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Iterator, Optional

from accel_train.base.errors import first_line

MAX_WORKER_RESTARTS = 3  # per epoch: a worker that keeps dying is a bug to see, not to hide
# How long a worker killed mid-handover may take to be reported dead (the fork server reaps it
# and writes its exit status; torch itself polls its workers every 5 s).
HANDOVER_DEATH_WAIT = 5.0


def worker_died(err: BaseException) -> bool:
    """torch's words for a loader worker that exited or was killed."""
    text = str(err)
    return isinstance(err, RuntimeError) and "DataLoader worker (pid" in text and (
        "exited unexpectedly" in text or "killed by signal" in text)


def dead_loader_worker(err: BaseException, wait: float = HANDOVER_DEATH_WAIT) -> Optional[str]:
    """What to say of `err` when it means a loader worker died (torch's first line, or one
    naming the pid that died during a batch's handover); None when it means anything else."""
    if worker_died(err):
        return first_line(err)
    if not isinstance(err, (OSError, EOFError)):
        return None
    iterator = _loader_iterator_in(err)
    if iterator is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        dead = [str(worker.pid) for worker in iterator._workers if not worker.is_alive()]
        if dead:
            return (f"DataLoader worker (pid(s) {', '.join(dead)}) died while handing over a "
                    f"batch: {type(err).__name__}: {first_line(err)}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def restarting_dead_workers(from_position: Callable[[], Iterator],
                            before_restart: Callable[[], None], where: Callable[[], str],
                            warn: Callable[[str], None]) -> Iterator:
    """`from_position()`'s batches; when a loader worker dies (the kernel's OOM killer does this
    when workers x prefetch x image size outgrow memory), a warning, `before_restart()`, and
    `from_position()` again: new workers from the position the loader has reached.  A training
    loader whose batches are a function of their position then goes on as if nothing had
    happened.  Any other error goes out as it came."""
    restarts = 0
    while True:
        try:
            yield from from_position()
            return
        except (RuntimeError, OSError, EOFError) as err:
            death = dead_loader_worker(err)
            if death is None or restarts >= MAX_WORKER_RESTARTS:
                raise
            restarts += 1
            before_restart()
            warn(f"a loader worker died ({death}) {where()}: its workers start again there "
                 f"({restarts} of at most {MAX_WORKER_RESTARTS} restarts this epoch). If the "
                 f"kernel's OOM killer did it (dmesg), lower --num-workers, --prefetch-factor "
                 f"or the image size")


def _loader_iterator_in(err: BaseException):
    """The multi-process DataLoader iterator that was taking a batch from its workers' queue
    when `err` was raised, from the traceback's frames (its `self`): neither torch nor
    Accelerate keeps a per-epoch iterator anywhere else.  None when the error came from
    anywhere else: an OSError a worker raised reading a file is re-raised by torch from
    another method, and is the worker's error to show, at once."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        # torch's private _MultiProcessingDataLoaderIter._try_get_data: should it be renamed,
        # the error goes out as torch raised it, as before.
        candidate = frame.f_locals.get("self")
        if frame.f_code.co_name == "_try_get_data" and \
                isinstance(getattr(candidate, "_workers", None), list) and \
                not getattr(candidate, "_shutdown", True):
            return candidate
        tb = tb.tb_next
    return None


def watch_workers_quietly(loader) -> Iterator:
    """Iterate `loader` with torch's SIGCHLD handler taken out once its workers exist.  That
    handler raises "DataLoader worker ... is killed by signal" wherever the main thread happens
    to be (seen: in the middle of a checkpoint write, which then failed); without it the loader
    finds a dead worker at its next batch (torch checks every MP_STATUS_CHECK_INTERVAL, 5 s),
    where IndexedTrainLoader restarts its workers."""
    for item in loader:
        # The handler is installed once per process, when the first workers start, so it is
        # there from the first batch on (Accelerate's loaders start theirs lazily).
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        yield item
