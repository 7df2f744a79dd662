"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is a few hundred tiny kernels, and launching them from Python
costs more than running them. A CUDA graph records one step's launches once and replays them with a
single call. A graph replays on the tensors it was recorded with, so a decode batch lives in
persistent tensors (token ids, positions, cache slots, sequence lengths, block tables) that each step
overwrites in place, and the graph reads them where it was told they are.

One graph is recorded per batch size of a ladder (1, 2, 4, 8, then every 16 up to `max_num_seqs`,
at most 512, vLLM's choice); a batch of n sequences replays the smallest graph of at least n rows,
its extra rows padded with a slot of -1 (the KV store skips them) and a length of one key, and
their outputs dropped. All graphs share one memory pool (recorded largest first, so the smaller
ones reuse its blocks). Prompts, mixed steps and larger batches run eagerly.

The graphs read the KV cache and the weights at the addresses they had when recorded; when either
moves (the cache is released and allocated again between rollouts, the trainer converts the weights)
they are dropped and recorded again, each size when it is next needed. The weights' values may change
freely (an optimizer step writes them in place), and under autocast the low-precision copies are made
inside the graph, from the current master weights, on every replay.

With `record=False` the same persistent tensors and padding run eagerly: what the CPU tests use to
hold this bookkeeping to the reference path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from pagedrl.engine.attention import PagedAttention, uniform_windows
from pagedrl.engine.host_tensors import long_tensor
from pagedrl.engine.kv_cache import KVCache

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first size that holds `max_num_seqs` (capped)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    cap = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = []
    for size in [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]:
        sizes.append(size)
        if size >= cap:
            break
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, max_num_seqs: int,
                 max_model_len: int, precision: Callable[[], contextlib.AbstractContextManager[Any]],
                 record: bool = True) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.precision, self.record = precision, record
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        rows, device = self.sizes[-1], model.device
        # Rows: token ids, positions, cache slots, sequence lengths; one host-to-device copy a step.
        self.ints = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.ints.unbind(0)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.long, device=device)  # one query each, always
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None
        self.fingerprint: tuple[int, ...] | None = None

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.max_batch and max_seq_len <= self.max_blocks * self.block_size

    def size_for(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, token_ids: list[int], positions: list[int], block_tables: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] of one decode step: sequence i feeds token_ids[i] at positions[i]
        and row i of `block_tables` (CPU int64 [n, width], from the persistent block table) covers
        that position. Valid until the next call."""
        n, bs = len(token_ids), self.block_size
        size = self.size_for(n)
        if self.record:  # record first: recording runs dummy rows through the persistent tensors
            self._check_fingerprint()
            if size not in self.graphs:
                with torch.cuda.device(self.model.device):
                    self.capture(size)
        host = torch.empty(4, size, dtype=torch.long)
        pos = long_tensor(positions)
        host[0, :n] = long_tensor(token_ids)
        host[1, :n] = pos
        host[2, :n] = block_tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
        host[3, :n] = pos + 1
        host[:, n:] = torch.tensor([0, 0, -1, 1])[:, None]  # padding rows: write nothing, read one key
        self.ints[:, :size].copy_(host)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        if not self.record:
            return self._forward(size)[0, :n]
        graph, out = self.graphs[size]
        with torch.cuda.device(self.model.device):  # the model's device, whichever is current
            graph.replay()
        return out[0, :n]

    def capture_all(self) -> None:
        """Record every size now (largest first, so the pool is sized once), e.g. at start-up."""
        if not self.record:
            return
        self._check_fingerprint()
        with torch.cuda.device(self.model.device):
            for size in reversed(self.sizes):
                if size not in self.graphs:
                    self.capture(size)

    def capture(self, size: int) -> None:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels), on dummy rows
        # that write no slot, so live sequences' keys and values are untouched.
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(size)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = (graph, out)

    def _forward(self, size: int) -> torch.Tensor:
        meta = PagedAttention(self.kv_cache, self.slot_mapping[:size], self.query_start_loc[:size + 1],
                              self.seq_lens[:size], self.block_tables[:size], self.positions[:size],
                              impl="triton", max_query_len=1, windows=uniform_windows(self.model))
        with self.precision():
            return self.model(self.input_ids[:size][None], self.positions[:size][None], meta)

    def drop(self) -> None:
        """Free every graph and its pool (the KV cache is being released); recorded again when needed."""
        self.graphs.clear()
        self.pool = None
        self.fingerprint = None

    def _check_fingerprint(self) -> None:
        """Drop every graph when the cache or a weight no longer lies where the graphs read it."""
        fingerprint = (self.kv_cache.data.data_ptr(), *(p.data_ptr() for p in self.model.parameters()))
        if fingerprint != self.fingerprint:
            self.drop()
            self.fingerprint = fingerprint
