"""Where a training step's time goes on a GPU: a callback that profiles a few of the trainer's
steps with torch.profiler, and a reading of the trace it writes.

The trace (Chrome's trace format, the profiler's public export) gives each GPU kernel's stream
and interval; from them: the window's wall time, how long each stream ran kernels, how long the
GPU ran any (the union of the streams), how long two streams ran at once, and the kernels that
took the most time.  Why the trace and not `key_averages()`: the averages have no streams, and
the question for an input path on a side stream is whether its kernels overlap the step's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Optional

import torch

from accel_train.callbacks import Callback

TOP_KERNELS = 12


class ProfileSteps(Callback):
    """Profiles the `count` steps after the first `skip` of the run, then writes the trace to
    `trace` (gzipped) and keeps its reading in `summary`."""

    def __init__(self, skip: int, count: int, trace: Path):
        self.skip, self.count, self.trace = skip, count, Path(trace)
        self.profiler: Optional[torch.profiler.profile] = None
        self.summary: Optional[dict] = None
        self.host_ops: list[tuple[str, float, int]] = []

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        elif step == self.skip + self.count and self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the last step's kernels inside the window
            self.profiler.stop()
            plain = self.trace.with_suffix("")
            self.profiler.export_chrome_trace(str(plain))
            self.summary = read_trace(json.loads(plain.read_text()), self.count)
            # the training thread's own time (torch's profiler records the operators of the
            # thread that started it: the decoding thread's are not among them)
            self.host_ops = [(a.key, a.self_cpu_time_total / 1e3 / self.count, a.count)
                             for a in sorted(self.profiler.key_averages(),
                                             key=lambda a: -a.self_cpu_time_total)[:TOP_KERNELS]]
            with gzip.open(self.trace, "wb") as packed:
                packed.write(plain.read_bytes())
            plain.unlink()
            self.profiler = None


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def read_trace(trace: dict, steps: int) -> dict:
    """{wall_ms, busy_ms (any kernel running), overlap_ms (kernels of two or more streams at
    once), streams: {id: ms}, top: [(kernel, ms, calls)]}, each per step; wall from the first
    event of the trace to its last."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    per_stream: dict[str, list[tuple[float, float]]] = {}
    totals: dict[str, list[float]] = {}
    for kernel in kernels:
        start = float(kernel["ts"])
        stream = str(kernel.get("args", {}).get("stream", kernel.get("tid")))
        per_stream.setdefault(stream, []).append((start, start + float(kernel["dur"])))
        total = totals.setdefault(kernel["name"], [0.0, 0])
        total[0] += float(kernel["dur"])
        total[1] += 1
    busy = merged([i for intervals in per_stream.values() for i in intervals])
    # time in two or more streams at once = the streams' own busy times summed - the union
    overlap = sum(length(merged(i)) for i in per_stream.values()) - length(busy)
    wall = (max(float(e["ts"]) + float(e["dur"]) for e in events) -
            min(float(e["ts"]) for e in events)) if events else 0.0
    per = 1e3 * max(1, steps)  # microseconds in the trace, milliseconds a step here
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"steps": steps, "wall_ms": wall / per, "busy_ms": length(busy) / per,
            "overlap_ms": overlap / per,
            "streams": {stream: length(merged(i)) / per for stream, i in per_stream.items()},
            "top": [(name[:90], ms / per, int(calls)) for name, (ms, calls) in top]}


def describe(summary: dict, host_ops: list[tuple[str, float, int]]) -> list[str]:
    """Lines for a report's notes."""
    wall = summary["wall_ms"] or float("nan")
    streams = ", ".join(f"stream {s} {ms:.1f} ms" for s, ms in
                        sorted(summary["streams"].items(), key=lambda item: -item[1]))
    lines = [f"profiled {summary['steps']} steps: {summary['wall_ms']:.1f} ms a step of wall "
             f"time, the GPU running kernels {summary['busy_ms']:.1f} ms of it "
             f"({summary['busy_ms'] / wall:.0%}), two streams at once "
             f"{summary['overlap_ms']:.1f} ms; by stream: {streams or 'no kernels'}",
             "kernels, ms a step (calls in the window): " + "; ".join(
                 f"{name} {ms:.2f} ({calls})" for name, ms, calls in summary["top"]),
             "the training thread's operators by their own time, ms a step (calls): " + "; ".join(
                 f"{name} {ms:.2f} ({calls})" for name, ms, calls in host_ops)]
    return lines
