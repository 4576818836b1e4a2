"""Telling a loader worker's death from other loader errors, whichever way torch reports it, and
letting the training process find it at a batch rather than wherever a signal lands.

torch reports a dead worker as a RuntimeError ("DataLoader worker (pid(s) N) exited
unexpectedly", or "... is killed by signal") when it sees the death itself.  It misses one case:
a worker killed while the main process is taking a batch from it.  A batch's tensors come over
a socket from the worker that made them (torch's file-descriptor sharing); the kill resets that
socket, and torch's own check that follows asks the workers whether they live before the fork
server has reported the death, finds them all alive and re-raises the bare socket error
(ConnectionResetError inside `rebuild_storage_fd`; seen in CI).  `naming_handover_deaths`
turns such an error into torch's words when one of the loader's workers is found dead: the
workers are this process's multiprocessing children when the first batch came
(`multiprocessing.active_children`: torch's iterator keeps its own list in private fields),
and dead is what `Process.is_alive` says once the fork server has reported the exit.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Callable, Iterable, Iterator, Optional

from accel_train.base.errors import first_line

MAX_WORKER_RESTARTS = 3  # per epoch: a worker that keeps dying is a bug to see, not to hide
# How long a worker killed mid-handover may take to be reported dead (the fork server reaps it
# and writes its exit status; torch itself polls its workers every 5 s).
HANDOVER_DEATH_WAIT = 5.0
HANDOVER = "died while handing over a batch"


def worker_died(err: BaseException) -> bool:
    """torch's words for a loader worker that exited or was killed, or naming_handover_deaths'."""
    text = str(err)
    return isinstance(err, RuntimeError) and "DataLoader worker (pid" in text and (
        "exited unexpectedly" in text or "killed by signal" in text or HANDOVER in text)


def worker_own_error(err: BaseException) -> bool:
    """An error a worker raised itself (reading a file), which torch raises again here with its
    own first words: the worker's to show at once, not a death."""
    return str(err).startswith(f"Caught {type(err).__name__} in DataLoader worker process")


def handover_death(err: BaseException, workers: Optional[Iterable[BaseProcess]],
                   wait: float = HANDOVER_DEATH_WAIT) -> Optional[str]:
    """torch's words for the death of one of `workers` that `err` (a socket error out of the
    loader's iterator) means, naming the pids found dead within `wait` seconds; None when
    none is (or the error is a worker's own, or the workers were never listed)."""
    if workers is None or not isinstance(err, (OSError, EOFError)) or worker_own_error(err):
        return None
    workers = list(workers)
    deadline = time.monotonic() + wait
    while True:
        dead = [str(worker.pid) for worker in workers if not worker.is_alive()]
        if dead:
            return (f"DataLoader worker (pid(s) {', '.join(dead)}) {HANDOVER}: "
                    f"{type(err).__name__}: {first_line(err)}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def naming_handover_deaths(loader: Iterable, wait: float = HANDOVER_DEATH_WAIT) -> Iterator:
    """`loader`'s batches; a socket error out of it that a dead worker explains goes out as a
    RuntimeError in torch's words for a death (worker_died), any other error as it came.  A
    death at the very first batch goes out as it came: its workers were not yet listed."""
    batches, workers = iter(loader), None
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, EOFError) as err:
            death = handover_death(err, workers, wait)
            if death is None:
                raise
            raise RuntimeError(death) from err
        if workers is None:  # the loader's workers run by now (Accelerate starts them lazily)
            workers = multiprocessing.active_children()
        yield batch


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
        except RuntimeError as err:
            if not worker_died(err) or restarts >= MAX_WORKER_RESTARTS:
                raise
            death = first_line(err)
            restarts += 1
            before_restart()
            warn(f"a loader worker died ({death}) {where()}: its workers start again there "
                 f"({restarts} of at most {MAX_WORKER_RESTARTS} restarts this epoch). If the "
                 f"kernel's OOM killer did it (dmesg), lower --num-workers, --prefetch-factor "
                 f"or the image size")


def watch_workers_quietly(loader) -> Iterator:
    """Iterate `loader` with torch's SIGCHLD handler taken out once its workers exist.  That
    handler raises "DataLoader worker ... is killed by signal" wherever the main thread happens
    to be (seen: in the middle of a checkpoint write, which then failed); without it the loader
    finds a dead worker at its next batch (torch checks every MP_STATUS_CHECK_INTERVAL, 5 s),
    where IndexedTrainLoader restarts its workers."""
    for item in naming_handover_deaths(loader):
        # The handler is installed once per process, when the first workers start, so it is
        # there from the first batch on (Accelerate's loaders start theirs lazily).
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        yield item
