"""Where loader workers come from: a fork server, never a fork of the training process.

By the time a loader starts its workers the training process has threads (gloo's, the queue
feeders of the loaders already running, the run lock's heartbeat, tqdm's monitor).  A fork
copies every lock as it stands at that instant, held or not, and only the forking thread goes on
in the child: a worker forked while another thread held a lock it needs hangs inside fork()
before it runs a line of its own, and its rank then waits for its first batch for ever (seen in
a 2-process run at an epoch end, where the held-out loader starts its workers while the training
loader's are busy).  Python documents this hazard, and 3.14 stops forking by default on Linux.

So every loader asks `worker_context()`: a fork server, started once per training process with
the modules workers need already imported (`PRELOAD`), forks each worker from its own single
thread.  A worker then costs an unpickling of its dataset, not an import of torch.

The server and the resource tracker multiprocessing starts with it live in the training
process's process group, which torchrun stops with SIGTERM to the whole group (and Ctrl-C
reaches as SIGINT).  A server killed by that would take the next workers with it (a worker whose
parent dies leaves: torch's watchdog) before the stop checkpoint is written, so the server starts
with both signals blocked, which its workers inherit; `init_worker` lets them hear them again
(multiprocessing stops a worker with SIGTERM), and each worker leaves the group anyway
(`loader_worker_in_own_group`).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Optional

from accel_train.base.errors import stacks_on_request
from accel_train.data.loader_watch import start_watch

# Imported once by the server: what a worker needs to unpickle its dataset and run it (each
# worker would import them again otherwise: seconds each).  The optional ones (Hugging Face
# datasets, for its sources) only where the training process has imported them itself.  Not
# timm's augmentation policies: every training process imports them with timm, and only a run
# with a timm --auto-augment string needs them in its workers.
PRELOAD = ["accel_train.data.loaders", "accel_train.data.streaming.loader"]
PRELOAD_IF_IMPORTED = ["datasets"]
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """The multiprocessing context every loader starts its workers with (a DataLoader's
    `multiprocessing_context`), its server running; None where there is no fork server
    (Windows: torch's default there, spawn, has no fork to fear)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver, resource_tracker

    context = multiprocessing.get_context("forkserver")
    preload = [name for name in PRELOAD_IF_IMPORTED if name in sys.modules]
    context.set_forkserver_preload(PRELOAD + preload)
    # The resource tracker first: starting it unblocks both signals on its way out (it blocks
    # them around its own start), which would undo the block below.
    resource_tracker.ensure_running()
    # Blocked, not ignored: a stop signal that arrives meanwhile waits for the restored mask
    # and reaches the training process then (an ignored one would be lost).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()  # once per process; later calls only check it lives
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return context


def worker_init_fn(read_timeout: float = 0) -> Callable[[int], None]:
    """A DataLoader's worker_init_fn for workers of this process (`init_worker`, with this
    process's pid: the training process each worker ends with)."""
    return functools.partial(init_worker, read_timeout=read_timeout, trainer=os.getpid())


def init_worker(worker_id: int, read_timeout: float, trainer: int) -> None:
    """A loader worker's start: it hears stop signals again (blocked since the server's start),
    leaves the training process's group, ends with the training process (`trainer`, its pid),
    answers SIGUSR1 with its stacks as the training process does, and watches for a read stuck
    for most of `read_timeout` (loader_watch.py)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    loader_worker_in_own_group(worker_id)
    end_with(trainer)
    stacks_on_request()
    start_watch(f"loader worker {worker_id}", read_timeout)


def end_with(pid: int) -> None:
    """This worker ends as soon as process `pid` has.  torch's own watchdog watches a worker's
    parent, here the fork server, which outlives a training process killed outright (SIGKILL, the
    OOM killer): its workers would wait for work for ever, and hold the server, which waits for
    them.  A pidfd wakes at the process's end, zombie or not; where there is none (not Linux),
    the process is looked for every second."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        handle = None

    def watch():
        if handle is not None:
            select.select([handle], [], [])
        else:
            while _exists(pid):
                time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, name="accel_train-trainer-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loader_worker_in_own_group(worker_id: int) -> None:
    """A DataLoader's worker_init_fn: the worker process leaves the training process's process
    group.

    torchrun stops a worker by signalling its whole process group (os.killpg), and Ctrl-C reaches
    the terminal's foreground group: a loader worker killed by that SIGTERM/SIGINT takes the
    training process down ("DataLoader worker is killed by signal") before its stop checkpoint.
    In a group of its own it hears only what is sent to it: the training process alone decides
    when to stop (StopSignals) and shuts its loaders down, multiprocessing's exit still terminates
    it directly, and a worker whose parent died exits by itself (torch's worker watchdog).
    Ignoring the signals instead would hang that exit (it terminates workers with SIGTERM)."""
    os.setpgid(0, 0)
