"""Freed memory kept for the next step on a CPU: glibc told to keep its heap, and a cache of large
freed blocks in front of torch's allocator.

Why: every step allocates the same large activations (a 2048-token prefill chunk's MLP products are
6 MB each) and frees them. glibc maps each allocation above its threshold (128 KB at first, rising
to the largest freed one) with fresh pages, or hands freed heap memory back to the kernel at the
top of the heap, so the next step touches new pages and the kernel zeroes every one of them on its
first write: measured on a 2048-token forward of the default model in bf16 (2 threads), the
matmuls took 300 ms instead of 233 and the fused SiLU*up 2.8 ms a call instead of 1.3. With the
threshold at its ceiling (32 MB) and no trimming, freed chunks stay in the heap and are reused; the
process keeps its peak memory instead of returning it, as a serving engine does anyway.

Blocks above glibc's ceiling are torch's to keep: the engine's C++ kernels (`csrc/block_cache.cpp`)
put a cache of freed blocks of 1 MiB and more in front of torch's CPU allocator, as torch's CUDA
allocator keeps freed device memory. A training step allocates the same large tensors every time (a
chunk of LM-head logits is 200 MB, the tied head's weight gradient 113 MB); mapped afresh, every page
is zeroed again, and on a VM whose host takes back the memory a guest frees, each first write is a
trip to the host: measured on the demo's GRPO step (default model, bf16, 2 threads), the forward's
LM head took 5.6 s (9.2 s of system time, 200 k page faults) against 0.23 s once its blocks were
kept, and the step went from 14.7 s to 10.2 s. The cache keeps at most a quarter of the machine's
memory; past that it gives back the blocks it has kept longest (sizes the steps stopped asking for).

Set once per process when the first engine's runner or trainer starts on a CPU; `PAGEDRL_KEEP_FREED=0`
leaves glibc and torch as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit: larger values are refused
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
BLOCK_CACHE_MIN_BYTES = 1 << 20  # smaller blocks: glibc's heap, kept by the settings above


@functools.cache
def keep_freed_memory() -> bool:
    """Whether freed memory is now kept, by glibc's settings or torch's block cache (False when
    turned off, or where neither applies)."""
    if os.environ.get("PAGEDRL_KEEP_FREED", "").strip().lower() in {"0", "false", "no", "off"}:
        return False
    glibc = _glibc_keeps_freed()
    return cache_large_blocks() or glibc


def _glibc_keeps_freed() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        logger.warning("glibc refused the allocator settings; freed memory goes back to the kernel")
    return done


def block_cache_limit() -> int:
    """The most bytes of freed blocks the cache keeps: a quarter of the machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def cache_large_blocks() -> bool:
    """Puts the block cache in front of torch's CPU allocator (where the kernels build)."""
    from pagedrl.engine import cpu_kernels

    if not cpu_kernels.available():
        return False
    return bool(torch.ops.pagedrl_cpu.cache_cpu_blocks(BLOCK_CACHE_MIN_BYTES, block_cache_limit()))


@dataclass(frozen=True)
class BlockCacheStats:
    installed: bool
    cached_bytes: int  # freed blocks kept for reuse
    cached_blocks: int
    live_blocks: int  # handed out and not yet freed
    hits: int  # requests served from a kept block
    misses: int  # requests that took fresh memory


def block_cache_stats() -> BlockCacheStats:
    """What the block cache holds and how often it was reused (all zero when not installed)."""
    from pagedrl.engine import cpu_kernels

    if not cpu_kernels.available():
        return BlockCacheStats(False, 0, 0, 0, 0, 0)
    installed, *rest = torch.ops.pagedrl_cpu.cpu_block_cache_stats()
    return BlockCacheStats(bool(installed), *rest)


def empty_block_cache() -> int:
    """Gives every kept block back to the system; returns the bytes freed."""
    from pagedrl.engine import cpu_kernels

    return int(torch.ops.pagedrl_cpu.empty_cpu_block_cache()) if cpu_kernels.available() else 0
