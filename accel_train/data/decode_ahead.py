"""The device path's next batch decoded while the trainer works on this one (--decode-on-device):
a thread of the training process starts decoding batch k+1 before batch k is handed out.

Why a thread: the device path's host half (nvJPEG's call, which parses the files and waits for
the hardware decoder, then the launches of the crops' kernels) took as long as the training
step's own launches.  In the training process's one thread the two ran one after the other, and
the GPU waited for the host: on an H200, 106 ms a step of ResNet-50 at batch 256 against the
step's 53 ms of kernels, the decoding's kernels never running beside the step's
(benchmarks/bench_gpu_jpeg.py --profile-steps).  torch's operators and torchvision's decoder
leave Python's lock while they run, so a second thread decodes while the first launches the
step and waits for its backward pass.

The order of the batches, their pixels and the loader's position (counted as the trainer takes
each batch) are those of decoding in line.  What reading ahead may not change:

* Accelerate learns that an epoch ends when its loader hands out the last batch, and
  `accumulate()` then synchronizes gradients there (its `sync_with_dataloader`): the epoch's
  last batch is therefore not taken from the loader before the trainer has the one before it.
* An error of the loader met while reading ahead (a worker's death, its timeout) is raised
  where it was raised before, after the batch in hand: the restart and the stop then name the
  same position.

On a GPU the thread queues its work on a stream of its own (`SideStream`), which the training
step's stream waits for by an event, not the host: the next batch's kernels run beside the
step's.  Held photographs' crops (--data-on-device, held_photos.py) are made ahead the same way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional, TypeVar

import torch

Raw = TypeVar("Raw")
Started = TypeVar("Started")
Ready = TypeVar("Ready")
Made = TypeVar("Made")
_END = object()  # `raw` has no more


class DecodeAhead:
    """One decoding thread, started with the first batch that needs it, ended by `close`."""

    def __init__(self):
        self._pool: Optional[ThreadPoolExecutor] = None

    def batches(self, raw: Iterator[Raw], count: int, start: Callable[[Raw], Started],
                hand_over: Callable[[Started], Ready]) -> Iterator[Ready]:
        """`hand_over(start(item))` for each of at most `count` items of `raw`, in order:
        `start` on the thread, for the next item while the caller holds the one before (never
        into the last of the `count`), `hand_over` in the caller's thread as it takes one."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-ahead")
        return _ahead(self._pool, raw, count, start, hand_over)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _ahead(pool: ThreadPoolExecutor, raw: Iterator[Raw], count: int,
           start: Callable[[Raw], Started], hand_over: Callable[[Started], Ready]) -> \
        Iterator[Ready]:
    pending: Optional[Future] = None
    deferred: Optional[Exception] = None
    taken = 0  # items taken from `raw`
    try:
        for _ in range(count):
            if deferred is not None:  # (only ever set below when a batch follows)
                raise deferred
            if pending is None:  # not read ahead: the first, or the epoch's last
                item = next(raw, _END)
                if item is _END:
                    return
                taken += 1
                pending = pool.submit(start, item)
            started, pending = pending.result(), None
            if taken < count - 1:  # the next is not the last: read it ahead
                try:
                    item = next(raw, _END)
                except Exception as err:  # raised after the batch in hand, as in line
                    deferred = err
                else:
                    if item is not _END:
                        taken += 1
                        pending = pool.submit(start, item)
            yield hand_over(started)
    finally:
        if pending is not None:  # a stop or an error: the thread's batch finishes, unused
            pending.exception()


class SideStream:
    """Work queued on a CUDA stream of its own, from any thread; on other devices, in line.

    Why a stream of its own: work queued on the training step's stream runs after the step,
    however early it was queued.  And the caching allocator hands a stream's allocations only
    blocks freed on that stream, so the side stream's work never writes memory the step's
    stream may still read (nvJPEG needs that: device_decode.decode_jpegs)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream: Optional["torch.cuda.Stream"] = None

    def run(self, work: Callable[[], Made]) -> tuple[Made, Optional["torch.cuda.Event"]]:
        """`work()`'s result, and on a GPU the event recorded after its work on the side stream
        (this work's, not the next call's after it): `taken_over` makes its tensors the
        caller's."""
        if self.device.type != "cuda":
            return work(), None
        with torch.cuda.device(self.device):  # (a thread starts on the first GPU)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                made = work()
                done = torch.cuda.Event()
                done.record(self._stream)
        return made, done


def taken_over(tensor: torch.Tensor, done: Optional["torch.cuda.Event"]) -> torch.Tensor:
    """`tensor`, made by `SideStream.run` before `done`, for the caller's stream: that stream
    waits for the event (the host does not), and the allocator does not hand the tensor's memory
    to the side stream again before the caller's stream is through with it."""
    if done is not None:
        caller = torch.cuda.current_stream(tensor.device)
        caller.wait_event(done)
        tensor.record_stream(caller)
    return tensor
