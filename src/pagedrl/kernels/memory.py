"""Freed memory kept for the next step on a CPU: glibc keeps its heap, and in a trainer's process
serves every block from it.

Why: every step allocates the same large tensors and frees them (a 2048-token prefill chunk's MLP
products are 6 MB each; a training step's chunk of LM-head logits 200 MB, the tied head's weight
gradient 113 MB). By default glibc maps each block above its threshold (128 KB at first, rising to
32 MB at most) afresh and unmaps it on free, and hands freed heap memory back to the kernel at the
top of the heap, so the next step touches new pages and the kernel zeroes every one of them on its
first write. Measured (default model, bf16, 2 threads): a 2048-token prefill's matmuls took 300 ms
instead of 233. On a VM whose host takes back the memory its guest frees, each such page is a trip
to the host (35-50 us here): one forward's LM head in a GRPO step took 5.6 s, 9.2 s of it system
time for 200 k page faults, against 0.23 s on kept memory.

So glibc's threshold for mapping a block on its own goes to its ceiling (32 MB) and the heap is
never trimmed: freed blocks below the threshold go back to the heap, where glibc coalesces them with
their free neighbours and splits them for later requests of any size. A trainer goes further: no
block is mapped on its own (`M_MMAP_MAX` 0), so its 100-200 MB blocks are kept as well; a GRPO step
of `bench/bench_grpo.py` in bf16 took 14.2 s against 21.5 with the threshold alone. A cache of freed
blocks in front of torch's allocator (kept by size, as torch's CUDA allocator does) was measured
against this and lost: it cannot hand a freed block to a larger request or split one for smaller
requests, so a GRPO stage after another stage in the same process (the demo) took its first step's
2 GB fresh (44 s against 18 s with the heap). An engine that only serves keeps mapping its largest
blocks: with every block from the heap, 64 prompts x 128 tokens ran at 545 output tokens/s against
592 (`bench/bench_vllm_cpu.py`, two turns each; the cause was not found). The process keeps its peak
memory instead of returning it, as a serving engine does anyway.

A trainer's tensors of 256 KB or more then come from a heap of their own (`csrc/block_pool.cpp`,
torch's CPU allocator, with the C++ kernels): in glibc's one heap, the small objects made beside a
step's activations (a tensor's metadata, autograd's nodes) that outlive it land in the holes the
freed activations leave, so the next micro-batch's slightly larger activations no longer fit them.
GRPO with LoRA on the default model (float32, `bench/bench_lora_grpo.py`): the heap grew to 4.0 GB
for 2.4 GB in use at most, and the process peaked at 4260 MiB; with the pool, 2823 MiB (QLoRA 4131
and 2496). The pool keeps its pages too: a full fine-tuning GRPO step as fast as on the kept heap.

Set once per process when the first engine's runner (`every_block=False`) or trainer
(`every_block=True`) starts on a CPU; blocks mapped before then stay mapped.
`PAGEDRL_KEEP_FREED=0` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit: larger values are refused
NEVER_TRIM = -1  # "disables trimming completely" (mallopt(3))
TOP_PAD = 64 << 20  # the heap grows 64 MB beyond a request: fewer brk calls
POOL_THRESHOLD = 256 << 10  # a trainer's tensors of this size or more live in the large-block pool


@functools.cache
def keep_freed_memory(every_block: bool = False) -> bool:
    """Whether glibc now keeps freed memory (False elsewhere, or when turned off); `every_block`:
    no block is mapped on its own (a trainer's process)."""
    if os.environ.get("PAGEDRL_KEEP_FREED", "").strip().lower() in {"0", "false", "no", "off"}:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = [(M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, TOP_PAD)]
    if every_block:
        settings.append((M_MMAP_MAX, 0))
    done = all(mallopt(param, value) == 1 for param, value in settings)
    if not done:
        logger.warning("glibc refused the allocator settings; freed memory goes back to the kernel")
    elif every_block:
        pool_large_blocks()
    return done


def pool_large_blocks() -> bool:
    """Whether a trainer's blocks of `POOL_THRESHOLD` bytes or more now come from a heap of their own
    (`csrc/block_pool.cpp`, within address space of twice the machine's memory); needs the C++
    kernels and no address-space limit (otherwise glibc's heap serves them as before);
    `PAGEDRL_BLOCK_POOL=0` leaves them there. Each heap keeps its own peak."""
    import resource

    from pagedrl.kernels import ops

    if os.environ.get("PAGEDRL_BLOCK_POOL", "").strip().lower() in {"0", "false", "no", "off"} or not ops.available():
        return False
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        return False  # its reservation would count against the limit, and other mappings would fail
    reserve = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not ops.install_block_pool(POOL_THRESHOLD, reserve):
        logger.warning("the large-block pool could not be installed; large tensors share glibc's heap")
        return False
    return True
