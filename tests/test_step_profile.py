"""benchmarks/step_profile.py's reading of a profiler trace: the streams' busy time, their
union and their overlap, against a trace written by hand with its figures worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from step_profile import describe, merged, read_trace  # noqa: E402


def _kernel(name: str, stream: int, start_us: float, end_us: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": end_us - start_us,
            "args": {"stream": stream}}


def test_intervals_merge_into_their_union():
    assert merged([(5, 7), (0, 2), (1, 3), (3, 4), (8, 9)]) == [(0, 4), (5, 7), (8, 9)]
    assert merged([]) == []


def test_two_streams_busy_union_and_overlap_per_step():
    # stream 7: 0-10 ms and 20-30 ms; stream 33: 5-15 ms; a host operator spans 0-40 ms; 2 steps
    trace = {"traceEvents": [
        _kernel("conv", 7, 0, 10_000), _kernel("conv", 7, 20_000, 30_000),
        _kernel("resize", 33, 5_000, 15_000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40_000},
        {"ph": "i", "name": "an instant, no duration", "ts": 50_000}]}
    summary = read_trace(trace, steps=2)
    # by hand: wall 40 ms / 2; the union 0-15 and 20-30 = 25 ms / 2; overlap 5-10 = 5 ms / 2
    assert summary["wall_ms"] == 20.0
    assert summary["busy_ms"] == 12.5
    assert summary["overlap_ms"] == 2.5
    assert summary["streams"] == {"7": 10.0, "33": 5.0}
    assert summary["top"] == [("conv", 10.0, 2), ("resize", 5.0, 1)]
    lines = describe(summary, [("aten::mm", 20.0, 1)])
    assert lines[0].startswith("profiled 2 steps: 20.0 ms a step of wall time, the GPU running "
                               "kernels 12.5 ms of it (62%), two streams at once 2.5 ms"), lines
    assert "aten::mm 20.00 (1)" in lines[2]


def test_a_trace_without_kernels_reads_as_none():
    summary = read_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0,
                                           "dur": 3_000}]}, steps=1)
    assert summary["busy_ms"] == 0 and summary["streams"] == {} and summary["wall_ms"] == 3.0
    assert "no kernels" in describe(summary, [])[0]
