"""Ranks forked by the launcher that the warm starter runs, instead of new interpreters.

A launcher a test starts (torchrun, `python -m torch.distributed.launch`, `accelerate launch`)
is forked by the warm starter (tests/warm_start.py), but the ranks it starts were new
interpreters, each paying the stack's imports (a few CPU seconds each, and the suite starts
about a hundred ranks: docs/development.md, "Which processes").  The launcher process has
imported the stack already, so here its rank is forked from the launcher itself: torch's
elastic agent (which all three launchers use for several processes) makes its ranks through
`subprocess_handler.Popen`, and `install` puts `rank_popen` there, whose Popen's child, instead
of exec'ing `python -u -m MODULE ARGS`, becomes that run in the forked image.  (Accelerate's
one-process launcher, for a MULTI_CPU config, starts `python -m accel_train` with
subprocess.Popen, which accel_train.run.rank_launcher then makes the ranks' launcher: there
`install` replaces subprocess.Popen too, and the forked process keeps both.)

What stays as a user's launch has it: the rank is the launcher's own child (its pid, its session
and process group from `start_new_session`, the launcher's waits, signals and restarts), with the
environment, descriptors, directory, command line (/proc/PID/cmdline) and argv the launcher gave
it, its streams unbuffered as `-u` makes them.  What a fork carries over from the launcher is
undone in the child: the launcher's signal handlers and mask, its descriptors beyond the run's
three (close_fds, as Popen's default), its atexit and finalizer registrations, its warnings
filters and root logging set-up, numpy's seed.  A run whose environment differs from the
launcher's in a variable read at import (anything but the ranks' own: `RANK_VARIABLES`) is
exec'd as before, and so is every rank when ACCEL_TRAIN_TEST_WARM_RANKS=0 or
ACCEL_TRAIN_TEST_WARM=0 (the starter is then not used at all).

The launcher is several threads by the time it starts ranks (its rendezvous store's server);
a fork keeps only the calling thread.  The child touches none of the launcher's objects but
the interpreter's own (the import machinery, which CPython re-initializes after a fork), and
ends with os._exit, as multiprocessing's forked children do, so nothing of the launcher's is
finalized in it.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import io
import logging
import os
import re
import signal
import subprocess
import sys
import traceback
import warnings
import weakref
from pathlib import Path

from tests.warm_start import (COMMAND_LINE_ROOM, RUN_TIME_VARIABLES, _changed, _command_line,
                              become_module_run, environment_fits, run_as_main)

# What torch's elastic agent and accelerate's launcher set for each rank; all are read when
# torch.distributed or accelerate start a run, not when they are imported.
RANK_VARIABLES = re.compile(RUN_TIME_VARIABLES.pattern + r"|TORCHELASTIC_\w+|GROUP_RANK"
                            r"|ROLE_RANK|ROLE_NAME|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE"
                            r"|ROLE_WORLD_SIZE|TORCH_NCCL_\w+|NCCL_\w+|ACCELERATE_\w+")


class _Launcher:
    """What the launcher's process was before its launcher ran: what each rank is reset to."""
    env: dict = {}
    warnings_filters: list = []
    root_handlers: list = []
    root_level = logging.WARNING
    register = staticmethod(atexit.register)
    exit_functions: list = []  # registered while the launcher ran: not the ranks'
    refused_log: str | None = None
    rank_modules: tuple = ()


def install(launcher: str, rank_modules, refused_log: str | None) -> None:
    """In the process of `launcher` (its module), before it runs: its ranks that are
    `python [-u] -m` of one of `rank_modules` are forked (each refusal noted in
    `refused_log`)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    _Launcher.env = dict(os.environ)
    _Launcher.warnings_filters = list(warnings.filters)
    _Launcher.root_handlers = list(logging.root.handlers)
    _Launcher.root_level = logging.root.level
    _Launcher.register = atexit.register
    _Launcher.refused_log = refused_log
    _Launcher.rank_modules = tuple(rank_modules)

    def noting_register(function, *args, **kwargs):
        _Launcher.exit_functions.append(function)
        return _Launcher.register(function, *args, **kwargs)

    atexit.register = noting_register
    subprocess_handler.Popen = rank_popen
    if launcher == "accelerate.commands.launch":
        # Its one-process launcher (a MULTI_CPU config) starts `python -m accel_train` with
        # subprocess.Popen; accel_train.run.rank_launcher makes that process the ranks' launcher
        # (torch's elastic agent): forked from here, it has both Popens of this module.
        subprocess.Popen = rank_popen


def rank_command(args, modules) -> tuple[str, list[str], bool] | None:
    """(module, its arguments, unbuffered) for `python [-u] -m MODULE ARGS` of `modules`."""
    args = [os.fsdecode(arg) for arg in args]
    if not args or args[0] != sys.executable:
        return None
    rest = args[1:]
    unbuffered = rest[:1] == ["-u"]
    rest = rest[1:] if unbuffered else rest
    if len(rest) < 2 or rest[0] != "-m" or rest[1] not in modules:
        return None
    return rest[1], rest[2:], unbuffered


def variables_read_at_import(env: dict, launchers: dict,
                             intel_openmp: bool | None = None) -> list[str]:
    """The variables of a rank's environment `env` that differ from its launcher's and are not
    the ranks' own (RANK_VARIABLES): where there are any, the rank must be a new process.
    KMP_* (which accelerate's one-process launcher sets) are read by Intel's OpenMP runtime as
    it loads, and by nothing else: they count where that runtime is loaded in this process
    (`intel_openmp`, read from /proc/self/maps when not given; torch's PyPI wheels load GNU's)."""
    if intel_openmp is None:
        intel_openmp = "libiomp5" in Path("/proc/self/maps").read_text()
    return sorted(name for name in _changed(env, launchers)
                  if not RANK_VARIABLES.fullmatch(name)
                  and (intel_openmp or not name.startswith("KMP_")))


def _refuse(args, why: str) -> None:
    if _Launcher.refused_log:
        with open(_Launcher.refused_log, "a") as note:
            note.write(f"rank: {why}: {' '.join(map(os.fsdecode, args))[:300]}\n")


def rank_popen(args, *more, **kwargs) -> subprocess.Popen:
    """subprocess.Popen as torch's SubprocessHandler and accelerate's one-process launcher call
    it (args; env, stdout, stderr, start_new_session): the rank forked where it can be, else
    exec'd by Popen itself (as is any other command, and any call with more positional
    arguments)."""
    command = None if more else rank_command(args, _Launcher.rank_modules)
    if command is None:
        return _POPEN(args, *more, **kwargs)
    if len(_command_line(list(map(os.fsdecode, args)))) > COMMAND_LINE_ROOM:
        _refuse(args, "a command line longer than COMMAND_LINE_ROOM")
        return _POPEN(args, **kwargs)
    env = dict(os.environ) if kwargs.get("env") is None else kwargs["env"]
    if not environment_fits(env):
        _refuse(args, "an environment larger than ENVIRONMENT_ROOM")
        return _POPEN(args, **kwargs)
    changed = variables_read_at_import(env, _Launcher.env)
    if changed:
        _refuse(args, f"variables read at import differ: {changed}")
        return _POPEN(args, **kwargs)
    return ForkedPopen(args, command, **kwargs)


_POPEN = subprocess.Popen  # (install may put rank_popen in its place)


class ForkedPopen(_POPEN):
    """A Popen whose child becomes the rank instead of exec'ing it."""

    def __init__(self, args, command, **kwargs):
        self._rank_command = command
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            if stream is not None:
                stream.flush()
        launchers = {fd: file for fd, file in _open_files().items()
                     if fd not in (0, 1, 2, *pass_fds)}
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _become(list(map(os.fsdecode, args)), self._rank_command,
                        dict(os.environ) if env is None else env, cwd,
                        (p2cread, c2pwrite, errwrite), launchers, start_new_session)
                code = _run(self._rank_command[0])
            except BaseException:  # noqa: BLE001 - the child must never return into the launcher
                traceback.print_exc()
            finally:
                os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _open_files(fds=None) -> dict[int, tuple[int, int]]:
    """Descriptor -> the file it is open on (device, inode), for `fds` or all this process has.

    The launcher's descriptors are closed in its rank (close_fds), but not every descriptor the
    child has at that number: a library's fork handler may have opened its own there (libuv's,
    in the launcher's rendezvous store, closes its signal lock's pipe in each child and opens a
    new one, at the same numbers; at the child's next fork it closes those numbers again,
    whatever they are by then, so they must stay its)."""
    found = {}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")] if fds is None else fds:
        try:
            status = os.fstat(fd)
        except OSError:
            continue
        found[fd] = (status.st_dev, status.st_ino)
    return found


# ----- in the forked child -----

_KEPT: list = []  # objects of the launcher's the child must never collect (see _become)


def _reset_signals() -> None:
    """As a new interpreter starts: default actions, SIGINT raising KeyboardInterrupt, SIGPIPE
    and SIGXFSZ ignored (CPython's start-up), nothing blocked, no wakeup descriptor, no
    faulthandler (whose handlers write to a descriptor number of the launcher's, which the run
    may reuse; Python's signal.getsignal does not see them)."""
    signal.set_wakeup_fd(-1)
    faulthandler.disable()
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            faulthandler.unregister(number)
        except (RuntimeError, ValueError):
            pass
        try:
            if number == signal.SIGINT:
                signal.signal(number, signal.default_int_handler)
            elif number in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(number, signal.SIG_IGN)
            else:
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _stream(fd: int, unbuffered: bool, like, line_buffering: bool):
    """sys.stdout/sys.stderr as a new interpreter opens them on `fd` (with -u: unbuffered)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors,
                            line_buffering=line_buffering or raw.isatty(),
                            write_through=unbuffered)


def _become(args, command, env, cwd, stdio, launchers, new_session) -> None:
    module, arguments, unbuffered = command
    _reset_signals()
    if new_session:
        os.setsid()
    gc.collect()  # the launcher's garbage ends here, before its descriptors are closed below
    for target, fd in enumerate(stdio):
        if fd != -1:
            os.dup2(fd, target)
    for fd, file in launchers.items():
        if _open_files([fd]).get(fd) == file:
            os.close(fd)
    if cwd is not None:
        os.chdir(cwd)
    # The launcher's stream objects are kept, never collected: collecting one would close its
    # descriptor (0, 1 or 2) under the run, which would then reuse the number for a file of its.
    _KEPT.extend((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__,
                  sys.__stderr__))
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered, sys.__stdout__, False)
    sys.stderr = sys.__stderr__ = _stream(2, unbuffered, sys.__stderr__, True)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r",
                                                                             closefd=False)))
    for function in _Launcher.exit_functions:
        atexit.unregister(function)
    # What this process registers from here on is noted in turn: it may start ranks itself
    # (accel_train.run.rank_launcher), which must not run its exit functions either.
    _Launcher.exit_functions = []
    weakref.finalize._registry.clear()
    if "multiprocessing.util" in sys.modules:
        sys.modules["multiprocessing.util"]._finalizer_registry.clear()
    warnings.filters[:] = _Launcher.warnings_filters
    warnings._filters_mutated()
    _KEPT.extend(logging.root.handlers)
    logging.root.handlers[:] = _Launcher.root_handlers
    logging.root.setLevel(_Launcher.root_level)
    become_module_run(module, arguments,
                      {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}, args)


def _run(module: str) -> int:
    """Runs `module` as __main__ and ends as the interpreter would: the exit code of SystemExit
    (its message on stderr), a traceback and 1 for an exception, death by SIGINT for an
    uncaught KeyboardInterrupt; non-daemon threads joined, atexit run, streams flushed."""
    import threading

    code = 0
    try:
        run_as_main(module)
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # as CPython ends on an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
