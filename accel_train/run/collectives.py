"""Collective timeouts: long while ranks may wait on each other for good reasons, tight while
they train; and, when one fires, which rank stalled and where.

The fault distributed training meets most is a hang: one rank stuck in a driver call, on a dead
network mount or in a deadlock, while every other rank waits for it in the next all-reduce.
With one timeout for everything it must be long enough for start-up, so a hang idles the whole
job that long.  torchtitan's answer, followed here: a generous timeout for start-up and the
first step, a tight one for the steps after it.

* The process group starts with LONG_TIMEOUT (distributed.setup), which covers process-group
  start-up, rank 0 preparing the data while the others wait, and each epoch's first step (its
  loader workers start).
* After an epoch's first optimizer step the trainer calls `tighten`: --collective-timeout, or by
  default the larger of TIGHT_MIN_SECONDS and TIGHT_STEPS x the slowest step any rank has seen
  (agreed by all, again at every log window).
* Waits that keep healthy ranks waiting on purpose run under `relaxed()` (the long timeout): an
  epoch end (evaluation, checkpoint), a checkpoint between epochs (rank 0 writes, the others wait
  at its barrier), the stop-signal checkpoint and the final save.  So a slow disk or a long
  evaluation cannot trip the tight timeout: a false restart of a healthy run cannot happen.
* Every rank leaves a heartbeat in the process group's store after each optimizer step (its
  step and the time).  When a collective times out, every live rank is waiting in it and times
  out too: each says so in the store, and the ranks that have not said so within a few seconds
  are the stalled ones, named with their last heartbeat.  Each live rank writes its Python
  stacks into its log, and the trainer exits with EXIT_STALLED, so that the elastic launcher
  (--max_restarts, `accel-train launch --elastic`, a SLURM requeue) restarts the group from the
  newest checkpoint.

`torch.distributed.set_timeout(timeout, group)` changes a live group's timeout: gloo applies it
to every later operation's wait (the wait raises in this process); NCCL applies it in its
watchdog, which aborts the communicator and ends the process when a collective overruns, with
TORCH_NCCL_ASYNC_ERROR_HANDLING on (set by distributed.setup when unset): there the stacks and
the heartbeat line are not written, but the hang still ends within the tight timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from accel_train.base.errors import STALLED_EXIT, first_line

LONG_TIMEOUT = timedelta(minutes=30)
TIGHT_MIN_SECONDS = 60.0
TIGHT_STEPS = 20
EXIT_STALLED = STALLED_EXIT  # a temporary failure, worth a restart (errors.py)
HEARTBEAT_KEY = "accel_train/heartbeat/rank{}"
TIMED_OUT_KEY = "accel_train/timed_out/rank{}"
REPORTED_KEY = "accel_train/stall_reported"
# A rank that ends on an error in the loop says which in the store before it goes, so that the
# ranks it leaves waiting name the error, not only a closed connection: the crash's own output
# may be on another machine, or lost in an interleaved console.
CRASHED_KEY = "accel_train/crashed/rank{}"
STORE_READ_SECONDS = 10.0  # a store that does not answer in this long is down (its host hung)
# The live ranks wait in the same collective and time out within moments of each other; each
# says so in the store, and the ranks that have not after this long are the stalled ones.
ARRIVAL_GRACE_SECONDS = 5.0


def is_timeout(err: BaseException) -> bool:
    """A collective that waited past its timeout (gloo: "Timed out waiting ...ms for recv"),
    or whose peer vanished meanwhile (the launcher killed it first)."""
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return "timed out" in text or "timeout" in text or "connection closed by peer" in text


class CollectiveTimeouts:
    """The timeouts of the groups a run uses (the default group and the control group), and
    the run's heartbeat.  For one process: all of it does nothing."""

    def __init__(self, groups: list, store: Optional[dist.Store], rank: int, world_size: int,
                 fixed_seconds: Optional[float]):
        self.groups, self.store = groups, store
        self.rank, self.world_size = rank, world_size
        self.fixed_seconds = fixed_seconds
        self.active = world_size > 1
        self.slowest_step = 0.0        # this rank's slowest step outside epochs' first steps
        self.tight_seconds: Optional[float] = None  # agreed; None until the first tighten
        self._tight_now = False

    def _set(self, seconds: float) -> None:
        for group in self.groups:
            dist.set_timeout(timedelta(seconds=seconds), group)

    def observe(self, step_seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, step_seconds)

    def tighten(self, agree_max: Callable[[float], float]) -> None:
        """Every rank at the same step: agree on the slowest step seen, set the tight timeout.
        (The agreement itself runs under whatever timeout is in force.)"""
        if not self.active:
            return
        slowest = agree_max(self.slowest_step)
        self.tight_seconds = self.fixed_seconds or max(TIGHT_MIN_SECONDS, TIGHT_STEPS * slowest)
        self._set(self.tight_seconds)
        self._tight_now = True

    def relax(self) -> None:
        if self.active and self._tight_now:
            self._set(LONG_TIMEOUT.total_seconds())
            self._tight_now = False

    @contextlib.contextmanager
    def relaxed(self):
        """A wait that healthy ranks may spend on purpose: under the long timeout."""
        was_tight = self._tight_now
        self.relax()
        try:
            yield
        finally:
            if was_tight:
                self._set(self.tight_seconds)
                self._tight_now = True

    def beat(self, step: int) -> None:
        """This rank has completed optimizer step `step`."""
        if self.active and self.store is not None:
            self.store.set(HEARTBEAT_KEY.format(self.rank),
                           json.dumps({"step": step, "time": time.time()}))

    def note_crash(self, step: int, err: BaseException) -> None:
        """This rank is ending on `err` during step `step`: its type and first line into the
        store, for the line the others print (best effort: the store may be what failed)."""
        if not self.active or self.store is None:
            return
        try:
            self.store.set(CRASHED_KEY.format(self.rank), json.dumps(
                {"step": step, "error": f"{type(err).__name__}: {first_line(err, 200)}"}))
        except (RuntimeError, ValueError):
            pass

    # -- when a collective timed out -------------------------------------------------------
    def _read(self, key: str) -> Optional[dict]:
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _who_did_not_arrive(self, my_step: int) -> Optional[dict[int, Optional[dict]]]:
        """Say in the store that this rank timed out, give the others ARRIVAL_GRACE_SECONDS to
        say the same, and return the ranks that did not, each with its last heartbeat (None
        if it left none); None if the store does not answer (its host is the one stalled)."""
        if self.store is None:
            return None
        try:
            self.store.set_timeout(timedelta(seconds=STORE_READ_SECONDS))
            self.store.set(TIMED_OUT_KEY.format(self.rank), json.dumps({"step": my_step}))
            others = [rank for rank in range(self.world_size) if rank != self.rank]
            deadline = time.monotonic() + ARRIVAL_GRACE_SECONDS
            while True:
                missing = [rank for rank in others
                           if not self.store.check([TIMED_OUT_KEY.format(rank)])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            return {rank: self._last_word(rank) for rank in missing}
        except (RuntimeError, ValueError):  # the store's host is gone or hung
            return None

    def _last_word(self, rank: int) -> Optional[dict]:
        """A rank's last heartbeat, with the error it ended on if it said one."""
        beat, crash = self._read(HEARTBEAT_KEY.format(rank)), \
            self._read(CRASHED_KEY.format(rank))
        return {**(beat or {}), "crash": crash} if crash else beat

    def describe_stall(self, my_step: int, peer_gone: bool = False) -> str:
        """One line: the timeout (or, `peer_gone`, the connection a rank closed by ending), the
        ranks that never arrived with their last completed step and how long ago, and where
        this rank stood."""
        waited = f"{self.tight_seconds:g} s for another rank (--collective-timeout)" \
            if self._tight_now else \
            f"{LONG_TIMEOUT.total_seconds():.0f} s for another rank (the long timeout)"
        lost = ("a collective lost another rank: its connection closed (that process ended: a "
                "crash or a kill; its own output says which)")
        head = (lost if peer_gone else f"a collective waited {waited}") + \
            f"; this is rank {self.rank}, at step {my_step}"
        absent = self._who_did_not_arrive(my_step)
        if absent is None:
            return (f"{head}; the process group's store does not answer, so its host (rank 0 "
                    f"or the launcher's agent) is the one that stalled")
        if not absent:
            return f"{head}; every rank timed out waiting: none stalled alone (a network fault?)"
        names = [describe_rank(rank, beat) for rank, beat in sorted(absent.items())]
        return f"{head}; {'gone' if peer_gone else 'stalled'}: {', '.join(names)}"

    def first_to_report(self) -> bool:
        """Only the first live rank to see the timeout prints the line (the others log it)."""
        if self.store is None:
            return True
        try:
            return self.store.add(REPORTED_KEY, 1) == 1
        except RuntimeError:
            return True


def dump_stacks(path) -> None:
    """Every thread's Python stack, appended to `path` (the rank's log)."""
    with open(path, "a") as handle:
        handle.write(f"\n--- Python stacks at {time.strftime('%Y-%m-%d %H:%M:%S')} "
                     f"(a collective timed out) ---\n")
        handle.flush()
        faulthandler.dump_traceback(file=handle, all_threads=True)


def describe_rank(rank: int, beat: Optional[dict]) -> str:
    """'rank 1 (last completed step 35, 61 s ago)', and the error it ended on if it said one."""
    crash = (beat or {}).get("crash")
    if crash:
        return (f"rank {rank} (ended on {crash['error']} in step {crash['step'] + 1}; its "
                f"traceback in its log, logs/rank{rank}.log)")
    if beat:
        return (f"rank {rank} (last completed step {beat['step']}, "
                f"{time.time() - beat['time']:.0f} s ago)")
    return f"rank {rank} (no step completed)"


class StepWatch:
    """The loop's side of the timeouts: after every optimizer step a heartbeat and the step's
    time, and the tight timeout agreed after each epoch's first step and at every log window
    (TIGHT_STEPS x the slowest step seen so far, on every rank)."""

    def __init__(self, timeouts: CollectiveTimeouts, agree_max: Callable[[float], float],
                 log_every: int):
        self.timeouts, self.agree_max, self.log_every = timeouts, agree_max, log_every
        self.first_step, self.step_started = 1, time.perf_counter()

    def start_epoch(self, step: int) -> None:
        """The epoch's first step waits for every rank's loader to start: the long timeout."""
        self.timeouts.relax()
        self.first_step, self.step_started = step + 1, time.perf_counter()

    def after_step(self, step: int) -> None:
        self.timeouts.beat(step)
        if step > self.first_step:
            self.timeouts.observe(time.perf_counter() - self.step_started)
        self.step_started = time.perf_counter()
        if step == self.first_step or step % self.log_every == 0:
            self.timeouts.tighten(self.agree_max)


def report_stall(timeouts: CollectiveTimeouts, err: RuntimeError, step: int, rank: int,
                 log, report) -> int:
    """A collective timed out: name who stalled, keep this rank's stacks in its `log`, and
    return EXIT_STALLED, so that the elastic launcher restarts the group from the newest
    checkpoint."""
    text = str(err).lower()
    line = timeouts.describe_stall(step, peer_gone="closed by peer" in text
                                   or "reset by peer" in text)
    # Where this rank waited (the error's traceback), then every thread as it is now.
    report.log_exception(f"{line} ({first_line(err, 300)})")
    dump_stacks(log)
    if timeouts.first_to_report():
        print(f"accel_train: error (rank {rank}): {line}; Python stacks in {log}; exit "
              f"{EXIT_STALLED}: restart the group (the elastic launcher does, --max_restarts) "
              f"with --resume auto", file=sys.stderr, flush=True)
    return EXIT_STALLED
