"""A CPU run keeps its freed host memory for the next step (train/host_memory.py).

Oracle: the kernel's own count of minor page faults (getrusage) over each of eight training
steps of a small convolutional network in plain torch (activations of 32 MiB each, above
glibc's mmap threshold) in a fresh Python process: with glibc's defaults every step faults its
activations in anew; after keep_freed_host_memory, the steps after the first few fault nothing
of the kind.  Each case runs in its own process, since malloc's settings hold for the process
that made them."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import subprocess
import sys

import pytest

from accel_train.train.host_memory import KEPT, keep_freed_host_memory, user_chose_allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the faults counted here are glibc malloc's (this C "
                                       "library is not glibc)")

FAULTS_OF_STEPS = """
import json, resource, sys, torch
from torch import nn
from accel_train.train.host_memory import keep_freed_host_memory
words = keep_freed_host_memory(False, json.loads(sys.argv[1])) if sys.argv[2] == "call" else None
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
images, labels = torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    loss = nn.functional.cross_entropy(net(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"words": words, "faults": faults}))
"""
ACTIVATION_PAGES = 64 * 32 * 64 * 64 * 4 // 4096   # one conv's output, float32


def _steps(environ: dict, call: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", FAULTS_OF_STEPS, json.dumps(environ),
                           "call" if call else "no"], capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items()
                               if user_chose_allocator({k: v}) is None})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_step_reuses_the_memory_the_step_before_freed():
    plain, kept = _steps({}, call=False), _steps({}, call=True)
    # glibc's defaults: every step maps its large activations afresh and faults them in
    assert all(count > 2 * ACTIVATION_PAGES for count in plain["faults"]), plain
    # kept: the first steps fault the heap in, the last three reuse it
    assert kept["words"] == KEPT
    assert sum(kept["faults"][-3:]) < min(plain["faults"]) / 4, (kept, plain)


@pytest.mark.slow
def test_an_allocator_the_environment_chose_is_left_alone():
    """MALLOC_* (glibc's settings, jemalloc's MALLOC_CONF), GLIBC_TUNABLES and LD_PRELOAD are the
    user's choice: nothing is changed, and the summary says why."""
    left = _steps({"MALLOC_ARENA_MAX": "2"}, call=True)
    assert left["words"] == "as the environment sets it (MALLOC_ARENA_MAX)"
    assert all(count > 2 * ACTIVATION_PAGES for count in left["faults"]), left
    assert user_chose_allocator({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"
    assert user_chose_allocator({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}) == \
        "GLIBC_TUNABLES"
    assert user_chose_allocator({"MALLOC_CONF": "background_thread:true"}) == "MALLOC_CONF"
    assert user_chose_allocator({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_a_cuda_run_leaves_the_host_allocator_alone():
    assert keep_freed_host_memory(True, {}) is None


def test_the_summary_names_the_variable_that_chose_the_allocator():
    """In this process (no malloc setting is changed on this path): the words the start summary
    prints name the first variable, in sorted order, through which the user chose."""
    assert keep_freed_host_memory(False, {"MALLOC_ARENA_MAX": "2", "LD_PRELOAD": "x.so"}) == \
        "as the environment sets it (LD_PRELOAD)"
    assert keep_freed_host_memory(False, {"GLIBC_TUNABLES": ""}) == \
        "as the environment sets it (GLIBC_TUNABLES)"
    assert keep_freed_host_memory(False, {"PYTHONPATH": "x", "XMALLOC_": "1"}) == KEPT


def test_in_this_process_a_freed_block_comes_back_without_faults():
    """In the test's own process: a 64 MiB block (above glibc's largest mmap threshold, 32 MiB),
    written and freed four times through the C library's own malloc; kept, the rounds after the
    first fault under a quarter of one block's pages (glibc's defaults map and fault it anew
    every round, as the first test shows in a fresh process)."""
    if user_chose_allocator(os.environ):
        pytest.skip(f"malloc as the environment sets it ({user_chose_allocator(os.environ)})")
    assert keep_freed_host_memory(False, {}) == KEPT
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 * 2**20
    faults = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert sum(faults[1:]) < size // 4096 // 4, faults
