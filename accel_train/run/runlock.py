"""One writer per run folder: the lock file `<output-dir>/run.lock` (rundir.LOCK_FILE).

Two starts on one folder (a requeued job that begins while the old one still writes its last
checkpoint, the same command typed twice) would each train, resume from the other's checkpoints
and write into the same files.  The global main rank takes the lock before the start plan moves,
renames or deletes anything (resume.plan_start); the other ranks of that run never look at it.
It is released at the end of the run, on an exception, and on a stop by signal.

The primitive: `os.open(O_CREAT | O_EXCL)` of the lock file.  Exclusive create is atomic on a
local filesystem, on NFSv3 and later (the client sends an exclusive CREATE that the server
decides) and on Lustre (the metadata server decides), so of two starts exactly one creates the
file, whichever machines they run on.  `fcntl.flock`/`lockf` are not used: on NFS they depend on
a lock manager (lockd / NFSv4 leases) that is often absent or emulated per client, and a lock
held by a machine that died is released only when the server notices.  The record (host, pid,
process start time, boot id, job) is written right after the create; a reader that finds it
empty or unreadable stops and names the file instead of guessing.

A lock whose holder is gone is stale and taken over:

* same machine: the pid no longer exists (or is a zombie), the machine has rebooted since (boot
  id), or the pid now belongs to a process started at another time (pid reuse);
* another machine: its pid cannot be asked, so the holder refreshes the file's modification time
  every HEARTBEAT_SECONDS (a thread), and a start that finds another machine's lock watches it for
  WATCH_SECONDS: unchanged that long, its holder is gone.  Watching a change, instead of comparing
  the mtime with our clock, needs no agreement between the machines' clocks; the file is opened
  for each look, so NFS's close-to-open consistency shows the server's current mtime rather than
  a cached one.  (A suspended job, SIGSTOP, stops its heartbeat too and would look gone.)
* another round of the same torchelastic job (same rendezvous id): the launcher ends a round on
  every machine before the next one forms, so the previous round's rank 0 is not writing any
  more, even where it ran on another machine.

A live holder of the same job (a requeued SLURM job, an elastic restart whose old rank 0 is
still exiting) is waited for, up to HANDOVER_SECONDS; any other live holder stops this start at
once, in one line naming its host, pid and the folder (exit code 2).

Taking a stale lock over renames it to a unique name first (only one start's rename succeeds),
then checks that the renamed file is the stale record it judged: a live lock grabbed by mistake
is put back.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from accel_train.base.errors import UsageError, first_line

HEARTBEAT_SECONDS = 10.0
WATCH_SECONDS = 3.5 * HEARTBEAT_SECONDS  # a few missed heartbeats, never one slow one
HANDOVER_SECONDS = 120.0  # a stop-save must fit in a launcher's kill grace period (30 s)
POLL_SECONDS = 0.5
ELASTIC_JOB_PREFIX = "torchelastic job "


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the process that holds it."""

    host: str
    pid: int
    started: Optional[float]  # the process's start time (seconds since the epoch), if known
    boot_id: Optional[str]
    job: Optional[str]        # distributed.run_lock_job(): the job this process belongs to
    token: str                # unique per acquisition

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) \
            if self.started else "at an unknown time"
        return f"host {self.host}, pid {self.pid}, started {when}" + \
            (f", {self.job}" if self.job else "")


def this_process(job: Optional[str]) -> Holder:
    pid = os.getpid()
    return Holder(socket.gethostname(), pid, process_start_time(pid), boot_id(), job,
                  uuid.uuid4().hex)


def boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux
        return None


def _proc_stat(pid: int) -> Optional[list[str]]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def process_start_time(pid: int) -> Optional[float]:
    """When `pid` started, in seconds since the epoch (Linux); None when unknown."""
    fields = _proc_stat(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    if fields is None:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)


def pid_alive(pid: int) -> bool:
    """True when `pid` is a running process of this machine (a zombie has finished)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    fields = _proc_stat(pid)
    return fields is None or fields[0] != "Z"


def read_holder(path: Path) -> Optional[Holder]:
    """The lock's holder; None when there is no lock file; a UsageError when it is unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UsageError(_unreadable(path, first_line(err))) from None
    try:
        data = json.loads(raw)  # bytes that are not UTF-8 raise a ValueError too
        holder = Holder(str(data["host"]), int(data["pid"]), data.get("started"),
                        data.get("boot_id"), data.get("job"), str(data["token"]))
    except (ValueError, KeyError, TypeError):
        raise UsageError(_unreadable(path, "not a lock record: empty, cut short or garbage")) \
            from None
    return holder


def _unreadable(path: Path, reason: str) -> str:
    return (f"{path} cannot be read ({reason}); another start may be writing it just now: if no "
            f"run uses {path.parent}, delete {path} and start again")


def _mtime(path: Path) -> Optional[float]:
    """The lock's modification time as its filesystem has it now (opened, so that an NFS client
    revalidates instead of answering from its attribute cache); None once it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def stale_reason(path: Path, holder: Holder, me: Holder,
                 sleep: Callable[[float], None] = time.sleep) -> Optional[str]:
    """Why the holder of the lock at `path` is gone (its lock may be taken over), or None."""
    if holder.host == me.host:
        if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
            return "this machine has restarted since"
        if holder.pid == me.pid:
            return "it is this process's own, left by an earlier run in it"
        if not pid_alive(holder.pid):
            return f"process {holder.pid} has exited"
        now_started = process_start_time(holder.pid)
        if holder.started and now_started and abs(now_started - holder.started) > 2:
            return f"pid {holder.pid} now belongs to another process"
        return None
    if holder.job and holder.job == me.job and holder.job.startswith(ELASTIC_JOB_PREFIX):
        return "a previous round of this elastic job, which its launcher ended"
    first = _mtime(path)
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline:
        sleep(POLL_SECONDS)
        if _mtime(path) != first:
            return None  # refreshed (alive), or released: the caller looks again
    return f"its heartbeat stopped (unchanged for {WATCH_SECONDS:.0f} s)"


def _create(path: Path, me: Holder) -> bool:
    """Create the lock file holding `me`; False if it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps(asdict(me)) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _break(path: Path, stale: Holder) -> None:
    """Remove the stale lock, unless another start replaced it meanwhile (then put that back).
    A file that cannot be read is not the stale record, which was read: it is another start's
    lock created and not yet written."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another start broke it first
    try:
        taken = read_holder(aside)
    except UsageError:
        taken = None
    if taken is None or taken.token != stale.token:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


class RunLock:
    """A lock this process holds: refreshed by a heartbeat thread until `release`."""

    def __init__(self, path: Path, me: Holder, created: list[Path]):
        self.path, self.me, self.created = path, me, created
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand; nothing left to refresh
                return

    def release(self) -> None:
        """Remove the lock if it is still ours, and the folders made only to hold it."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            holder = read_holder(self.path)
            if holder is not None and holder.token == self.me.token:
                self.path.unlink()
        except (UsageError, OSError):
            pass  # replaced or damaged by someone else: theirs to deal with
        _remove_folders(self.created)  # a failed start leaves no trace


def _make_folder(folder: Path) -> list[Path]:
    """Create `folder` (and missing parents); the ones created, outermost first."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def take(path: Path, job: Optional[str], warn: Callable[[str], None],
         sleep: Callable[[float], None] = time.sleep) -> RunLock:
    """The lock file `path` (its folder made if missing) for this process, or a UsageError
    naming the run that holds it."""
    me = this_process(job)
    created = _make_folder(path.parent)
    deadline = time.monotonic() + HANDOVER_SECONDS
    while True:
        if _create(path, me):
            return RunLock(path, me, created)
        try:
            holder = read_holder(path)
        except UsageError:
            _remove_folders(created)
            raise
        if holder is None:
            continue  # released between our create and our read
        reason = stale_reason(path, holder, me, sleep)
        if reason is not None:
            _break(path, holder)
            warn(f"took over {path} from a run that is gone ({holder.describe()}): {reason}")
            continue
        if holder.job and holder.job == job and time.monotonic() < deadline:
            sleep(POLL_SECONDS)  # the same job's previous holder, still finishing
            continue
        _remove_folders(created)
        raise UsageError(_held(path, holder, me))


def _held(path: Path, holder: Holder, me: Holder) -> str:
    how = (f"`ps -p {holder.pid}` on {holder.host} shows whether it still runs"
           if holder.host == me.host else
           f"its lock is refreshed every {HEARTBEAT_SECONDS:.0f} s while it runs, and taken over "
           f"by a start that sees no refresh for {WATCH_SECONDS:.0f} s")
    return (f"--output-dir {path.parent} is in use by another run ({holder.describe()}); wait "
            f"for it to end or stop it, or choose another --output-dir ({how}; if it is gone, "
            f"delete {path})")


def _remove_folders(created: list[Path]) -> None:
    """The folders made only to hold the lock, innermost first, while they are empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            break  # not empty: the run wrote into it
