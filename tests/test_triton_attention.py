"""The Triton paged-attention kernels, run on the CPU under Triton's interpreter, and the choices
around them that need no kernel.

The kernel cases (tests/triton_interpreted_cases.py) run in a fresh interpreter with
TRITON_INTERPRET=1: the variable only takes effect if set before triton is first imported, and in
this session other modules (transformers' models) import it first. Nothing here changes the
environment of any other test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import FAMILIES

from pagedrl.engine.attention import resolve_impl
from pagedrl.engine.cuda_graphs import graph_batch_sizes
from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

CASES = Path(__file__).with_name("triton_interpreted_cases.py")
WINDOW_CASES = Path(__file__).with_name("triton_window_cases.py")


def test_kernels_equal_the_reference_under_the_interpreter() -> None:
    """GQA, head_dim 24, partial last blocks, a prefix hit, chunked prefill, query and key tiles cut
    anywhere, the KV store, the whole engine, the CUDA-graph path's padded persistent batch, and its
    recording and re-recording with CUDA's calls faked (see the cases file); float32 and float16."""
    run_interpreted(CASES)


def test_kernel_under_layer_rules_equals_the_reference_under_the_interpreter() -> None:
    """Sliding windows (inside a block, a block, across blocks), soft-capped scores and attention sinks;
    the blocks every window has left are never read (see the cases file)."""
    run_interpreted(WINDOW_CASES)


def run_interpreted(cases: Path) -> None:
    """The cases file in a fresh interpreter with TRITON_INTERPRET=1; every case passes, none skipped."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                           str(cases)],
                          cwd=cases.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in .*", summary), summary  # none skipped, none deselected


def test_graph_batch_ladder() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256] and len(graph_batch_sizes(256)) == 20
    assert graph_batch_sizes(10_000)[-1] == 512


def test_attention_impl_auto_picks_the_kernels_on_cuda_only() -> None:
    assert resolve_impl("auto", "cuda") == "triton" and resolve_impl("auto", "cpu") == "fast"
    assert resolve_impl("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="attention_impl"):
        EngineConfig(attention_impl="flash").validate()
    llm = LLM.from_module(CausalLM(ModelConfig.from_dict(FAMILIES["smollm2-like"])), kv_cache_tokens=64)
    assert llm.engine.runner.attention_impl == "fast" and llm.engine.runner.graphs is None
