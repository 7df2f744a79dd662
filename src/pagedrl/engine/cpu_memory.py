"""Freed memory kept for the next step on a CPU: glibc serves every block from its heap and never
gives the heap back.

Why: every step allocates the same large tensors and frees them (a 2048-token prefill chunk's MLP
products are 6 MB each; a training step's chunk of LM-head logits 200 MB, the tied head's weight
gradient 113 MB). By default glibc maps each block above its threshold (128 KB at first, rising to
32 MB at most) afresh and unmaps it on free, and hands freed heap memory back to the kernel at the
top of the heap, so the next step touches new pages and the kernel zeroes every one of them on its
first write. Measured (default model, bf16, 2 threads): a 2048-token prefill's matmuls took 300 ms
instead of 233. On a VM whose host takes back the memory its guest frees, each such page is a trip
to the host (35-50 us here): one forward's LM head in a GRPO step took 5.6 s, 9.2 s of it system
time for 200 k page faults, against 0.23 s on kept memory.

So no block is mapped on its own (`M_MMAP_MAX` 0) and the heap is never trimmed: a freed block goes
back to the heap, where glibc coalesces it with its free neighbours and splits it for later requests
of any size. A block cache in front of torch's allocator (freed blocks kept by size, as torch's CUDA
allocator does) was measured against this and lost: it cannot hand a freed block to a larger request
or split one for smaller requests, so a GRPO stage after another stage in the same process (the
demo) took its first step's 2 GB fresh (44 s against 19 s with the heap), and `bench/bench_grpo.py`
was 14.2 against 13.6 s a bf16 step. The process keeps its peak memory instead of returning it, as
a serving engine does anyway.

Set once per process when the first engine's runner or trainer starts on a CPU (blocks mapped
before then stay mapped); `PAGEDRL_KEEP_FREED=0` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # mallopt's parameters (malloc.h)
NEVER_TRIM = -1  # "disables trimming completely" (mallopt(3))
NO_MMAP = 0  # the most blocks glibc maps on their own
TOP_PAD = 64 << 20  # the heap grows 64 MB beyond a request: fewer brk calls


@functools.cache
def keep_freed_memory() -> bool:
    """Whether glibc now keeps freed memory (False elsewhere, or when turned off)."""
    if os.environ.get("PAGEDRL_KEEP_FREED", "").strip().lower() in {"0", "false", "no", "off"}:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, NO_MMAP), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, TOP_PAD)))
    if not done:
        logger.warning("glibc refused the allocator settings; freed memory goes back to the kernel")
    return done
