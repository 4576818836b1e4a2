"""A CPU run's freed host memory kept for its next step, instead of handed back to the kernel.

Why: glibc's malloc serves every request above its mmap threshold (32 MiB at most) with a fresh
mmap and unmaps it when freed.  A CPU training step allocates activations of tens to hundreds of
MiB and frees them again, so each step faults the same memory in anew, page by page, each page
zeroed by the kernel.  Measured on a 2-core AMD EPYC with AVX512-BF16 (cifar_airbench, batch
1024, bf16, one process): 70,000-156,000 minor page faults a second, 0.13-0.29 of a core in the
kernel, 729-855 img/s; with mmap off and the heap never trimmed, no faults and 915-923 img/s,
the same losses.  torch's CPU launcher (`python -m torch.backends.xeon.run_cpu`) gets there by
preloading jemalloc or tcmalloc, which must happen before the process starts; glibc's `mallopt`
does it from inside the process, for every allocation after the call.  The cost: the process
keeps its peak heap until it exits, which a training process holds again at its next step.

Left alone where the user chose an allocator (LD_PRELOAD) or malloc settings (MALLOC_* variables,
GLIBC_TUNABLES), on C libraries other than glibc, and on CUDA runs (their step's
tensors live in the GPU's own caching allocator).
"""

from __future__ import annotations

import ctypes
import platform
from typing import Mapping, Optional

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # mallopt takes a C int: the largest top of the heap kept is 2 GiB

KEPT = "freed blocks kept for the next step (glibc malloc: no mmap, no trim)"


def user_chose_allocator(environ: Mapping[str, str]) -> Optional[str]:
    """The variable through which the user set the allocator or its settings, if any."""
    for name in sorted(environ):
        if name in ("LD_PRELOAD", "GLIBC_TUNABLES") or name.startswith("MALLOC_"):
            return name
    return None


def keep_freed_host_memory(cuda: bool, environ: Mapping[str, str]) -> Optional[str]:
    """On a CPU run under glibc, no mmap for large blocks and no trimming of the heap; returns
    the start summary's words for what was done or left alone (None on CUDA runs)."""
    if cuda:
        return None
    chosen = user_chose_allocator(environ)
    if chosen:
        return f"as the environment sets it ({chosen})"
    if platform.libc_ver()[0] != "glibc":
        return "the C library's own (not glibc)"
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "glibc's defaults (mallopt refused)"
    return KEPT
