"""How long training waited for its input: the "data_wait" share of each logged window.

On a CPU the loop's own wall time in `next(batches)` is the wait: nothing else runs meanwhile.
On a GPU that clock lies both ways.  The host returns from a non-blocking copy at once while the
device may still be busy with the previous step (the host's wait is then not the device's),
and a blocking copy would count the device's unfinished work as data wait.  What costs a GPU
is the time its stream has nothing to do but the input: CUDA events recorded into the stream
before the batch is fetched and after it is copied and normalized measure exactly that (the
idle gap, if the host was late, plus the copy and the normalization).
"""

from __future__ import annotations

import time
from typing import Callable, Union


class HostWaitClock:
    """Wall time the training loop spent fetching batches."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now, self.seconds, self._started = now, 0.0, 0.0

    def before_fetch(self) -> None:
        self._started = self.now()

    def after_fetch(self) -> None:
        self.seconds += self.now() - self._started

    def take(self) -> float:
        """The wait since the last take, in seconds; the clock starts again from 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class StreamWaitClock:
    """Device time between an event recorded before each fetch and one recorded after the
    batch's copy and normalization were queued.  Events are read only in `take` (at a logged
    step, where the loss's .item() has synchronized anyway): no sync per step."""

    def __init__(self, event_type=None):
        if event_type is None:
            import torch
            event_type = torch.cuda.Event
        self.event_type, self.pairs, self._start = event_type, [], None

    def _recorded(self):
        event = self.event_type(enable_timing=True)
        event.record()
        return event

    def before_fetch(self) -> None:
        self._start = self._recorded()

    def after_fetch(self) -> None:
        self.pairs.append((self._start, self._recorded()))

    def take(self) -> float:
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()  # the stream executes events in order
        milliseconds = sum(start.elapsed_time(end) for start, end in self.pairs)
        self.pairs = []
        return milliseconds / 1000


WaitClock = Union[HostWaitClock, StreamWaitClock]


def data_wait_clock(device_type: str) -> WaitClock:
    return StreamWaitClock() if device_type == "cuda" else HostWaitClock()
