"""The trainer's large-block pool (`kernels/csrc/block_pool.cpp`): torch's CPU allocator for blocks of
256 KB or more, best fit over free blocks that merge with their neighbours. Each check runs in a
process of its own, since the pool, once installed, stays torch's allocator for the process (and
this one's kernels are loaded only there, from the suite's cache)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedrl.kernels import ops

SRC = str(Path(__file__).resolve().parents[1] / "src")

PRELUDE = """
import torch
from pagedrl.kernels import ops
MB = 1 << 20
assert ops.available() and ops.install_block_pool(256 << 10, 1 << 36)
stats = ops.block_pool_stats
"""


def run_child(body: str, **env: str) -> str:
    """Runs PRELUDE + body in a fresh interpreter; its own asserts fail the test with its stderr."""
    assert ops.available()  # built here, into the suite's cache, before the child loads them
    full_env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_second_install_keeps_the_first_pool_and_the_profiler_sees_its_blocks() -> None:
    run_child("""
    assert ops.install_block_pool(1 << 30, 1 << 30)  # still torch's allocator: the first one's settings
    x = torch.empty(MB, dtype=torch.uint8)
    assert stats()["in_use"] == MB
    del x
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = torch.empty(4 * MB, dtype=torch.uint8)
        del y
    sizes = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::empty"]
    assert 4 * MB in sizes, sizes
    """)


def test_freed_neighbours_merge_and_the_top_takes_back_the_last_block() -> None:
    run_child("""
    a, b, c = (torch.empty(MB, dtype=torch.uint8) for _ in range(3))
    assert b.data_ptr() == a.data_ptr() + MB and c.data_ptr() == b.data_ptr() + MB  # cut from the top in order
    del a, b
    assert stats()["free"] == 2 * MB
    d = torch.empty(2 * MB, dtype=torch.uint8)  # only the merged block holds it: no growth
    assert stats()["top"] == 3 * MB and stats()["free"] == 0
    del c, d
    assert stats() == {"in_use": 0, "free": 0, "top": 0, "peak": 3 * MB, "writable": 64 * MB}, stats()
    """)


def test_best_fit_takes_the_smallest_free_block_that_holds_a_request() -> None:
    run_child("""
    big, keep1, small, keep2 = (torch.empty(n * MB, dtype=torch.uint8) for n in (3, 1, 1, 1))
    small_at = small.data_ptr()
    del big, small  # free: 3 MB at the bottom, 1 MB between the kept blocks
    again = torch.empty(MB, dtype=torch.uint8)
    assert again.data_ptr() == small_at
    rest = torch.empty(3 * MB, dtype=torch.uint8)  # the 3 MB block, whole
    assert stats()["free"] == 0 and stats()["top"] == 6 * MB
    """)


def test_small_tensors_stay_with_the_allocator_before_and_values_are_kept() -> None:
    run_child("""
    small = torch.arange(1000, dtype=torch.float32)  # 4 KB: below the threshold
    assert stats()["in_use"] == 0
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    assert stats()["in_use"] == 2 * MB
    y = (x @ x.T).sum(dim=1)
    ref = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0)).double()
    torch.testing.assert_close(y.double(), (ref @ ref.T).sum(dim=1), rtol=1e-4, atol=1e-2)
    assert float(small.sum()) == 499500.0
    """)


def test_small_objects_kept_between_steps_do_not_split_the_freed_space() -> None:
    # A training step's pattern: activations with small objects made beside them, some of which
    # outlive the step; the next step's activations are a little larger. In the pool, the freed
    # space merges whole, so the second step grows it only by the difference.
    run_child("""
    kept = []
    def step(rows):
        saved = []
        for _ in range(40):
            saved.append(torch.empty(rows, 4096))
            kept.append(torch.empty(8))  # small, outlives the step
        return sum(t.numel() * 4 for t in saved)
    first = step(64)
    assert stats()["peak"] == first and stats()["in_use"] == 0 and stats()["top"] == 0
    second = step(72)
    assert stats()["peak"] == second, stats()
    """)


def test_onednn_scratch_space_from_either_heap() -> None:
    # oneDNN's bf16 products take their scratch space through the allocator's raw interface, whose
    # deleter must free a pointer from the pool and one from the allocator before alike.
    run_child("""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 7, 300, 2048):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        w = torch.randn(1536, 576, generator=g).bfloat16()
        got = torch.nn.functional.linear(x, w).float()
        torch.testing.assert_close(got, x.float() @ w.float().T, rtol=2e-2, atol=2e-1)
        torch.testing.assert_close(torch.mm(x, w.T).float(), got)
    del x, w, got
    assert stats()["in_use"] == 0
    """)


def test_threads_allocate_and_free_at_once() -> None:
    run_child("""
    import threading
    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(200):
            t = torch.empty((1 + (i * 7 + seed) % 9) * 65536, dtype=torch.float32)
            t.fill_(seed)
            assert float(t[-1]) == seed
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert stats()["in_use"] == 0 and stats()["free"] == 0 and stats()["top"] == 0
    """)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a trainer keeps freed memory on glibc only")
def test_a_trainer_process_installs_it_and_the_switch_leaves_it_out() -> None:
    body = """
    from pagedrl.kernels.memory import keep_freed_memory
    keep_freed_memory(every_block=True)
    print(bool(ops.block_pool_stats()))
    """
    plain = "import torch\nfrom pagedrl.kernels import ops\n"
    assert ops.available()
    for env, expected in (({}, "True"), ({"PAGEDRL_BLOCK_POOL": "0"}, "False"), ({"PAGEDRL_KEEP_FREED": "0"}, "False")):
        env = {"PAGEDRL_KEEP_FREED": "1", "PAGEDRL_BLOCK_POOL": "1", **env}
        out = subprocess.run([sys.executable, "-c", plain + textwrap.dedent(body)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": SRC, **env}, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == expected
