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
(distributed.loader_worker_in_own_group).

A server started the usual way is a new interpreter that imports torch and torchvision again
(seconds of CPU, and its own copy of their memory, in every training process of a machine).  So
a command that may use workers forks it from itself first (`start_server_now`), while it is
still what a new server would be: one Python thread, no process group, no file but its standard
streams and the imports done.  The server then shares those pages with it and starts at once.
Where that cannot be had (another Python thread already runs, a multiprocessing whose server
works otherwise), `worker_context` starts the usual one; a run that ends up with no workers
stops the early one (`stop_unused_server`).
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import inspect
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from .distributed import loader_worker_in_own_group
from .errors import STACKS_SIGNAL, stacks_on_request
from .loader_watch import start_watch

# Imported once by the server: what a worker needs to unpickle its dataset and run it (each
# worker would import them again otherwise: seconds each).  The optional ones (Hugging Face
# datasets, for its sources) only where the training process has imported them itself.  Not
# timm's augmentation policies: every training process imports them with timm, and only a run
# with a timm --auto-augment string needs them in its workers.
PRELOAD = ["accel_train.data", "accel_train.streaming.loader"]
PRELOAD_IF_IMPORTED = ["datasets"]
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


# Python 3.14's server takes an authentication key as well; this module forks only the server
# whose start it mirrors (3.10 to 3.13), and starts any other the usual way.
_SERVER_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


class _EarlyServer:
    """The server `start_server_now` forked: which optional modules it holds, and whether a
    loader has asked for it yet."""
    pid: Optional[int] = None
    modules: frozenset = frozenset()
    asked = False


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """The multiprocessing context every loader starts its workers with (a DataLoader's
    `multiprocessing_context`), its server running; None where there is no fork server
    (Windows: torch's default there, spawn, has no fork to fear)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver, resource_tracker

    context = multiprocessing.get_context("forkserver")
    preload = [name for name in PRELOAD_IF_IMPORTED if name in sys.modules]
    if _EarlyServer.pid is not None:
        _EarlyServer.asked = True
        if not set(preload) <= _EarlyServer.modules:  # imported since: a worker would again
            stop_unused_server(asked_or_not=True)
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


def start_server_now(also: Sequence[str] = ()) -> bool:
    """Fork the loader workers' server from this process now (module docstring), for a command
    that may start workers: call it before anything starts a thread or opens a file, naming in
    `also` the optional modules (PRELOAD_IF_IMPORTED) its data will be read with.  False where
    it cannot be done safely; `worker_context` then starts the usual server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import connection, forkserver, resource_tracker, util

    for name in [*PRELOAD, *also]:
        __import__(name)
    server = forkserver._forkserver
    if (threading.active_count() != 1 or getattr(server, "_forkserver_pid", 0) is not None
            or list(inspect.signature(forkserver.main).parameters) != _SERVER_MAIN_PARAMETERS):
        return False
    modules = frozenset(name for name in PRELOAD_IF_IMPORTED if name in sys.modules)
    resource_tracker.ensure_running()  # first, as worker_context explains
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):  # else a file in multiprocessing's
        os.chmod(address, 0o600)                        # temporary folder, removed at exit
    listener.listen()
    alive_r, alive_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # a buffered line must not be written twice
        stream.flush()
    # Frozen, nothing from before the fork is ever collected in the server: garbage with a file
    # in it, closed by the server's collector, could close a descriptor the server has since
    # reused.  (No gc.collect first: the freeze alone keeps that garbage from the server's
    # collector, and a collection here walks the whole heap, a large share of a short run's
    # start where the heap is big.)
    gc.freeze()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r)  # never returns
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        gc.unfreeze()
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = pid
    _EarlyServer.pid, _EarlyServer.modules, _EarlyServer.asked = pid, modules, False
    return True


def _serve(listener_fd: int, alive_r: int) -> None:
    """The forked server: made to look like a new one (the interpreter's own signal handlers, no
    descriptor but its standard streams and its two), then multiprocessing's server loop until
    every holder of the "alive" pipe has gone."""
    from multiprocessing import forkserver

    code = 0
    try:
        if STACKS_SIGNAL is not None:
            faulthandler.unregister(STACKS_SIGNAL)
        for sig in signal.valid_signals():
            if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
                signal.signal(sig, signal.SIG_DFL)
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            if high > low + 1:  # descriptors lie between these two kept ones
                os.closerange(low + 1, high)
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # the server's own way out: no process needs it any more
        pass
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)


def stop_unused_server(asked_or_not: bool = False) -> None:
    """Stop the server `start_server_now` forked if no loader asked for it (or, with
    `asked_or_not`, in any case): a run without workers keeps no idle process, and a later
    loader gets the usual server."""
    from multiprocessing import forkserver

    if _EarlyServer.pid is None or (_EarlyServer.asked and not asked_or_not):
        return
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid == _EarlyServer.pid:
            server._stop_unlocked()
    _EarlyServer.pid = None


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
    start_watch(worker_id, read_timeout)


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
