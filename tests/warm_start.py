"""A warm starter: `python -m MODULE ARGS` runs forked from a process that imported the stack once.

Every new Python process a test starts pays seconds of CPU importing torch (torch._dynamo
included), torchvision, timm, accelerate and datasets before it reads an argument, and the suite
starts a few hundred: most of its time (docs/development.md, "Which processes").  A warm starter
is a process of the test session's that imports them once and then only forks: each run is a
child that takes the run's descriptors, directory, environment, argv and session, runs the
module as `__main__` as `python -m` does, and ends through the interpreter's normal exit
(atexit handlers, flushed streams, SystemExit's code, a traceback and 1 for an exception).

The forks are safe because the starter has done nothing but import: one thread (checked), no
torch operation run (no OpenMP pool to break across a fork), nothing written to its streams.
What a fork cannot change is what the imports read from the environment (HF_HUB_OFFLINE,
OMP_NUM_THREADS, ...): a run whose environment differs from the starter's in any variable but
the ones read at run time (`RUN_TIME_VARIABLES`) gets a new process, as does any command but
`python -m` of `WARM_MODULES`, and every command when ACCEL_TRAIN_TEST_WARM=0.  A launcher
(torchrun, `python -m torch.distributed.launch`, `accelerate launch`) a test starts is forked
too, but the ranks it starts are its own new processes, as a user's are: what the launcher does
with them (sessions, signals, restarts) is the launcher's code, unchanged.

The starter is a child of the pytest worker; it reports each run's pid and exit status over a
socket of that run's, kills a run whose socket its caller closed (the test process died), and
kills what is left and exits when the pytest worker goes.
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

WARM_ENV = "ACCEL_TRAIN_TEST_WARM"
LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
# What a test may run as `python -m MODULE`; a launcher's ranks of these are forked too.
WARM_MODULES = ("accel_train", "tests.fault_entry", "tests.budget_skew_entry",
                "tests.equiv_probe", "tests.warm_probe", "accelerate.commands.accelerate_cli",
                *LAUNCHERS)
# What the starter imports besides the modules it runs: what a training, eval or fault run
# imports before its work.
IMPORTS = ("accel_train.cli", "accel_train.trainer", "accel_train.commands.eval",
           "accel_train.commands.predict", "accel_train.commands.export",
           "accel_train.run.rank_launcher", "accel_train.model.syncbn", "datasets",
           "timm", "timm.optim", "torchvision", "accelerate", "numpy.ctypeslib", "PIL.Image",
           "psutil", "safetensors.torch", "torch.utils.serialization",
           "multiprocessing.forkserver")
# Variables read when they are used, not when a module is imported: a run may set or change
# them and still be forked.  The tests' fault switches, the trainer's own settings, the manual
# launch's rank variables, pytest's own, two of torch's elastic agent (read as it stops a
# round and as it sets up its rendezvous).
RUN_TIME_VARIABLES = re.compile(r"(FAULT_\w+|ACCEL_TRAIN_\w+|PYTEST_\w+|BUDGET_SKEW_SECONDS"
                                r"|RANK|LOCAL_RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT"
                                r"|TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
                                r"|TORCH_DISABLE_SHARE_RDZV_TCP_STORE)")
# A launcher's ranks are forked by the launcher (tests/warm_ranks.py) unless this is "0".
WARM_RANKS_ENV = "ACCEL_TRAIN_TEST_WARM_RANKS"
READY = b"ready"
# Bytes the starter's own command line leaves for a run's (an argument of this many dashes):
# a forked run writes `python -m MODULE ARGS` over it, for `ps`, psutil and the tests that find
# a run's processes by their command line.
COMMAND_LINE_ROOM = 1 << 15
# The same for a run's environment (/proc/PID/environ): a variable of the starter's own, which
# a run's environment replaces.
ENVIRONMENT_ROOM = {"ACCEL_TRAIN_TEST_ENVIRONMENT_ROOM": "-" * (1 << 15)}


def _changed(env: dict, base: dict) -> set[str]:
    return {name for name in env.keys() | base.keys() if env.get(name) != base.get(name)}


def forkable(env: dict, base: dict) -> bool:
    """Whether a run with environment `env` may be forked from a starter started with `base`."""
    return all(RUN_TIME_VARIABLES.fullmatch(name) for name in _changed(env, base))


class WarmProcess:
    """What subprocess.Popen offers the tests, for a run forked by the starter: pid, poll,
    wait, send_signal, kill, returncode (negative: the signal that ended it); and, once it has
    ended, cpu_seconds (user + system, its own and its waited-for children's)."""

    def __init__(self, reply: socket.socket, args: list[str],
                 ended: Callable[[float], None] = lambda cpu_seconds: None):
        self._reply, self.args, self._ended = reply, args, ended
        self.returncode: Optional[int] = None
        self.cpu_seconds: Optional[float] = None
        self.pid = json.loads(self._receive(timeout=60))["pid"]
        self._pipes: dict[str, Optional[int]] = {}
        self._output: dict[str, bytearray] = {}
        self._text = False
        self.stdout = self.stderr = None

    def capture(self, pipes: dict[str, int], text: bool) -> None:
        """`pipes`: "stdout"/"stderr" -> our read end, for those PIPE was asked for: read
        either through `communicate` (which closes each at its end) or, as Popen's, through
        the file objects `stdout` and `stderr`."""
        self._pipes = dict(pipes)
        self._output = {name: bytearray() for name in pipes}
        self._text = text
        for name, fd in pipes.items():
            setattr(self, name, open(fd, "r" if text else "rb"))  # closes fd when closed

    def _receive(self, timeout: Optional[float]) -> bytes:
        ready, _, _ = select.select([self._reply], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("warm run", timeout)
        message = self._reply.recv(4096)
        if not message:
            raise RuntimeError("the warm starter went away")
        return message

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            ended = json.loads(self._receive(timeout))
            self.returncode, self.cpu_seconds = ended["code"], ended["cpu_seconds"]
            self._reply.close()
            self._ended(self.cpu_seconds)
        return self.returncode

    def poll(self) -> Optional[int]:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: Optional[float] = None):
        """Popen.communicate for the PIPEs asked for (no input): their whole output, then the
        exit.  Past `timeout`, TimeoutExpired, the run left going and what was read kept for
        the next call (as Popen's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reading = {fd: name for name, fd in self._pipes.items() if fd is not None}
        while reading:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(reading), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                self._output[reading[fd]] += chunk
                if not chunk:
                    name = reading.pop(fd)
                    getattr(self, name).close()
                    self._pipes[name] = None
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(None if name not in self._output else _text(bytes(self._output[name]))
                     if self._text else bytes(self._output[name]) for name in ("stdout", "stderr"))


class WarmStarter:
    """The pytest worker's side: starts the starter on first use, then forks runs through it.

    `baseline()` is the environment a run gets when a test asks for nothing else (conftest's
    test_env): the starter is started with it.  A library may set a variable for the rest of
    the pytest process (torch's compiler sets TORCHINDUCTOR_CACHE_DIR the first time it
    compiles): when the baseline has moved that way, and a run asks for the new one, the
    starter is started again with it rather than every later run getting a new process.
    Each run refused is noted, with the variables that refused it, in LOG.refused."""

    def __init__(self, baseline: Callable[[], dict], cwd: Path, log: Path,
                 modules=WARM_MODULES, imports=IMPORTS):
        """`modules`: those it runs forked (and imports first), `imports`: what else it imports
        before forking (IMPORTS: what the suite's runs import; a test of the starter's own
        workings passes fewer)."""
        self.baseline, self.cwd, self.log = baseline, Path(cwd), Path(log)
        self.modules, self.imports = tuple(modules), tuple(imports)
        self.base_env: dict = {}
        self._control: Optional[socket.socket] = None
        self._process: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self.broken = os.environ.get(WARM_ENV, "1") == "0"
        self.starts = 0
        # CPU seconds of the runs it forked that have been waited for (a caller's os.times
        # counts only its own children)
        self.forked_cpu_seconds = 0.0
        self._retired: list[subprocess.Popen] = []  # starters closed: reaped once they end

    def _start(self) -> None:
        self.base_env = self.baseline()
        self.starts += 1
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self.log.open("a") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_start", str(theirs.fileno()),
                 ",".join(self.imports), ",".join(self.modules), "-" * COMMAND_LINE_ROOM],
                cwd=self.cwd, env={**self.base_env, **ENVIRONMENT_ROOM},
                stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=[theirs.fileno()])
        theirs.close()
        ready, _, _ = select.select([ours], [], [], 180)
        if not ready or ours.recv(64) != READY:
            self._process.kill()
            self.broken = True
            print(f"warm starter did not start (a new process for each run): "
                  f"{self.log.read_text()[-2000:]}", file=sys.stderr)
            return
        self._control = ours

    def _count(self, cpu_seconds: float) -> None:
        with self._lock:
            self.forked_cpu_seconds += cpu_seconds

    def _refuse(self, cmd: list[str], why: str) -> None:
        with open(f"{self.log}.refused", "a") as note:
            note.write(f"{why}: {' '.join(cmd)[:300]}\n")

    def popen(self, cmd: list[str], *, env: dict, cwd: Path, stdin: int, stdout: int,
              stderr: int, new_session: bool = False) -> Optional[WarmProcess]:
        """The run of `cmd` forked by the starter, or None where it must be a new process."""
        if (self.broken or cmd[:2] != [sys.executable, "-m"] or len(cmd) < 3
                or cmd[2] not in self.modules):
            return None
        if len(_command_line(cmd)) > COMMAND_LINE_ROOM:
            self._refuse(cmd, "a command line longer than COMMAND_LINE_ROOM")
            return None
        with self._lock:
            if self._control is not None and self._process.poll() is not None:
                self._refuse(cmd, f"(the starter had ended, exit {self._process.returncode}: "
                                  f"started again)")
                self.close()
            if self._control is not None and not forkable(env, self.base_env):
                moved = self.baseline()
                if forkable(env, moved) and not forkable(moved, self.base_env):
                    self.close()  # the pytest process's own environment changed
            if self._control is None and not self.broken:
                self._start()
            if self.broken:
                return None
            if not forkable(env, self.base_env):
                self._refuse(cmd, "variables read at import differ: " + str(sorted(
                    name for name in _changed(env, self.base_env)
                    if not RUN_TIME_VARIABLES.fullmatch(name))))
                return None
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            request = json.dumps({"module": cmd[2], "args": cmd[3:], "env": env,
                                  "cwd": str(cwd), "new_session": new_session,
                                  "refused_log": f"{self.log}.refused",
                                  "rank_modules": [module for module in self.modules
                                                   if module not in LAUNCHERS]}).encode()
            socket.send_fds(self._control, [request], [theirs.fileno(), stdin, stdout, stderr])
            theirs.close()
        return WarmProcess(ours, cmd, ended=self._count)

    def start(self, cmd: list[str], *, env: dict, cwd: Path, stdout=None, stderr=None,
              text: bool = False, new_session: bool = False):
        """subprocess.Popen(cmd, cwd=, env=, stdin=DEVNULL, stdout=, stderr=, text=,
        start_new_session=): a WarmProcess where the run can be forked, else a Popen.
        stdout and stderr as Popen takes them: None (this process's), a file, a descriptor,
        subprocess.PIPE, and subprocess.STDOUT for stderr."""
        mine, theirs = {}, {}
        for name, target in (("stdout", stdout), ("stderr", stderr)):
            if target == subprocess.PIPE:
                mine[name], theirs[name] = os.pipe()
            elif target is None:
                theirs[name] = 1 if name == "stdout" else 2
            elif target == subprocess.STDOUT:
                theirs[name] = theirs["stdout"]
            else:
                theirs[name] = target if isinstance(target, int) else target.fileno()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            process = self.popen(cmd, env=env, cwd=cwd, stdin=devnull, stdout=theirs["stdout"],
                                 stderr=theirs["stderr"], new_session=new_session)
        finally:
            os.close(devnull)
            for name in mine:
                os.close(theirs[name])
        if process is None:
            for fd in mine.values():
                os.close(fd)
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, text=text,
                                    start_new_session=new_session)
        process.capture(mine, text)
        return process

    def run(self, cmd: list[str], *, env: dict, cwd: Path,
            timeout: Optional[float]) -> subprocess.CompletedProcess:
        """subprocess.run(cmd, cwd=, env=, stdin=DEVNULL, capture_output=True, text=True,
        timeout=), forked where it can be."""
        process = self.start(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(cmd, process.returncode, out, err)

    def close(self) -> None:
        """Tells the starter to take no more runs (it ends when the runs going have ended, or
        their callers are gone) and forgets it: the next run starts a new one."""
        if self._control is not None:
            self._control.close()
            self._control = None
            self._retired.append(self._process)
            self._retired = [process for process in self._retired if process.poll() is None]


def _command_line(cmd: list[str]) -> bytes:
    """/proc/PID/cmdline's form: each argument ended by a NUL."""
    return b"".join(os.fsencode(part) + b"\0" for part in cmd)


def _show_command_line(cmd: list[str]) -> None:
    """Writes `cmd` over this process's command line, the memory /proc/PID/cmdline reads (the C
    runtime does not read it after the start): `ps`, psutil, the tests that find a run's
    processes by their command line and accel_train's own look at its launcher's
    (rank_launcher) then see the run's.  The rest of the starter's longer line reads as empty
    arguments after it (psutil lists them as ""): ending the area sooner (prctl
    PR_SET_MM_ARG_END) needs CAP_SYS_RESOURCE, and setproctitle(3)'s way (one line up to a NUL)
    loses where each argument ends."""
    _write_start_area(48, _command_line(cmd))


def _environment_block(env: dict) -> bytes:
    """/proc/PID/environ's form: NAME=VALUE, each ended by a NUL."""
    return b"".join(os.fsencode(f"{name}={value}") + b"\0" for name, value in env.items())


def environment_fits(env: dict) -> bool:
    start, end = _start_area(50)
    return len(_environment_block(env)) < end - start


def show_environment(env: dict) -> None:
    """Writes `env` over the environment this process was started with, the memory
    /proc/PID/environ reads (psutil's Process.environ(): the tests find a launcher's ranks by
    their RANK there), where it fits in the room the starter was started with
    (ENVIRONMENT_ROOM); the rest reads as the end of the block (a NUL after a NUL)."""
    if environment_fits(env):
        _write_start_area(50, _environment_block(env))


def _start_area(first_field: int) -> tuple[int, int]:
    """proc(5)'s (48) arg_start, (49) arg_end or (50) env_start, (51) env_end."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[first_field - 3]), int(fields[first_field + 1 - 3])


def _write_start_area(first_field: int, data: bytes) -> None:
    start, end = _start_area(first_field)
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        memory.write(data.ljust(end - start, b"\0")[:end - start])


def _text(data: bytes) -> str:
    """As subprocess's text mode reads a pipe: the locale's encoding, universal newlines."""
    import locale

    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ----- the starter process -----

class _Job:
    """A forked child's run: becomes the process `python -m MODULE ARGS` would have been."""

    def __init__(self, request: dict, stdio: list[int]):
        self.request, self.stdio = request, stdio

    def become(self) -> None:
        request = self.request
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(self.stdio):
            os.dup2(fd, target)
        for fd in set(self.stdio) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        become_module_run(request["module"], request["args"], request["env"],
                          [sys.executable, "-m", request["module"], *request["args"]])

    def run(self) -> None:
        self.become()
        if self.request["module"] in LAUNCHERS and os.environ.get(WARM_RANKS_ENV, "1") != "0":
            from tests import warm_ranks

            warm_ranks.install(self.request["module"], self.request["rank_modules"],
                               self.request.get("refused_log"))
        run_as_main(self.request["module"])


def become_module_run(module: str, args: list[str], env: dict, command: list[str]) -> None:
    """What a forked run takes on to be `command` (`python [-u] -m MODULE ARGS`) in its folder:
    the environment (also where /proc/PID/environ reads it), sys.path[0], the command line
    (sys.orig_argv, /proc/PID/cmdline), sys.argv and numpy's seed."""
    os.environ.clear()
    os.environ.update(env)
    show_environment(os.environ)
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.orig_argv = list(command)
    _show_command_line(sys.orig_argv)
    sys.argv = [module, *args]  # runpy puts the file in argv[0]
    if "numpy" in sys.modules:  # a new process's numpy is seeded anew; Python's random is
        sys.modules["numpy"].random.seed()  # reseeded at fork by Python itself


def run_as_main(module: str) -> None:
    """runpy's `python -m MODULE`.  The starter imported the module (for what it imports); a
    new process has not, and runpy warns on stderr about a module it runs as __main__ that was
    imported already.  (A package runs its __main__, which nobody imported.)"""
    import importlib.util
    import runpy

    if importlib.util.find_spec(module).submodule_search_locations is None:
        sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _serve(control: socket.socket) -> _Job:
    """The starter's loop; returns only in a forked child, with that child's job."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs: dict[int, socket.socket] = {}  # pid -> its reply socket
    gone: set[int] = set()  # runs whose caller closed the socket: killed, waiting to be reaped
    accepting = True
    while accepting or runs:
        watched = [wake_read, *(reply for pid, reply in runs.items() if pid not in gone)]
        try:
            ready, _, _ = select.select([control, *watched] if accepting else watched, [], [])
        except InterruptedError:
            continue
        if control in ready:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
            if not message:  # closed: no more runs; those going keep their callers (a run
                accepting = False  # whose caller is gone too is killed below)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                # detached first: a socket object collected later must not close a descriptor
                # number the run has reused by then
                for fd in (wake_read, wake_write, control.detach(), fds[0],
                           *(reply.detach() for reply in runs.values())):
                    os.close(fd)
                return _Job(json.loads(message), fds[1:])
            reply = socket.socket(fileno=fds[0])
            for fd in fds[1:]:
                os.close(fd)
            reply.sendall(json.dumps({"pid": pid}).encode())
            runs[pid] = reply
        if wake_read in ready:
            try:
                while os.read(wake_read, 512):
                    pass
            except BlockingIOError:
                pass
        for pid, reply in list(runs.items()):
            if reply in ready and pid not in gone:  # its caller closed it: nobody waits for it
                gone.add(pid)
                _kill(pid)
        while runs:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            reply = runs.pop(pid, None)
            gone.discard(pid)
            if reply is not None:
                try:  # its CPU time with what it waited for: its caller's os.times cannot see it
                    reply.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status),
                                              "cpu_seconds": usage.ru_utime + usage.ru_stime}
                                             ).encode())
                except OSError:
                    pass
                reply.close()
    os._exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _main(control_fd: int, imports: list[str], modules: list[str]) -> None:
    import importlib

    for name in (*imports, *modules):
        importlib.import_module(name)
    if "accel_train.data.synthetic" in sys.modules:
        # the embedded set's test split, which every run on it makes first (once per process)
        sys.modules["accel_train.data.synthetic"].held_out_split()
    control = socket.socket(fileno=control_fd)
    if threading.active_count() != 1:  # a fork would lose the other threads mid-work
        print(f"warm starter: {threading.active_count()} threads after the imports",
              file=sys.stderr)
        sys.exit(1)
    try:  # a run must be able to show its own command line: where it cannot, no warm starts
        _show_command_line(sys.orig_argv)
    except OSError as error:
        print(f"warm starter: cannot write its command line ({error})", file=sys.stderr)
        sys.exit(1)
    # What the imports made stays as long as the starter: frozen, a run's collections and its
    # exit's never walk it again (the finalization of a process that imported torch, timm and
    # the rest is mostly that walk: docs/development.md; gc.freeze's documented use before forks).
    gc.freeze()
    control.send(READY)
    job = _serve(control)
    job.run()


if __name__ == "__main__":
    _main(int(sys.argv[1]), [name for name in sys.argv[2].split(",") if name],
          sys.argv[3].split(","))
