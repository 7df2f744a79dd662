"""Paged attention: the engine's `AttentionMetadata`, reading and writing the block KV cache.

Each step the engine flattens every scheduled sequence's new tokens into one row (input_ids and
positions of shape [1, N]) and builds one `PagedAttention` for it, from the block tables the KV
cache manager keeps in a persistent tensor (`from_block_tables`; `build` takes lists and checks them). In every layer `attend` first
writes the new keys and values into their cache slots, then lets each sequence's new queries attend
causally over everything that sequence has cached, found through its block table. Query i of a
sequence with q_len new tokens and seq_len tokens in all sits at position seq_len - q_len + i, so a
fresh prompt, a chunk of a prompt whose prefix is cached, and a one-token decode are one case.

Three implementations compute the same thing:
- `reference`: one sequence at a time, keys gathered into a contiguous tensor, an explicit causal
  mask, softmax, matmul (`reference_attention`). Slow and obviously right; the tests hold the fast
  path to it. A layer with a sliding window, soft-capped scores (Gemma 2) or attention sinks
  (gpt-oss) takes the kernels that honour them (`layer_rules`: the row kernel, the Triton kernel).
- `fast`: on a CPU, a step of decodes only runs `ops.paged_decode`, which reads each
  sequence's keys and values from its blocks where they lie (one pass over them); without AMX a
  step with prompt chunks runs `ops.paged_prefill` (a prompt's rows in tiles over the blocks where
  they lie, bf16 or float32; `prefill_by_rows`). Other steps, and
  decodes where that kernel is not built: sequences in groups, each group attended in one batched op. A group's keys and values
  are gathered block-wise with one `index_select` apiece into a reused buffer, then handed to
  `scaled_dot_product_attention` as strided [S, Hkv, L, D] views (no transpose copy, no keys
  repeated per query head). Decodes (one query each) put the G query heads of one KV head in as
  G queries of that head: they share a position, hence one mask row, and one call replaces a loop
  over heads. Prefills (several queries each, fresh or chunked) use grouped-query attention,
  queries padded to the group's longest. On a CPU groups are cut small enough that what is
  gathered is still in cache when it is read (`attention_groups`); on a GPU there is one group
  per kind. Every index and additive mask is built once per step, not once per layer.
  In batch-invariant mode (`model/batch_invariant.py`) every step, prefill or decode, runs
  `ops.paged_attention` one query row at a time, so a token gets the bits a trainer's
  packed forward computes for it.
- `triton`: the kernels of `triton_attention`, which read keys and values through the block table
  where they lie; what the engine runs on a GPU (on a CPU only under Triton's interpreter).

A model with multi-head latent attention (DeepSeek-V3) caches latents, not keys and values; its
layers call `attend_latent` (`engine/latent_attention.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedrl.engine import latent_attention, layer_rules
from pagedrl.engine.attention_groups import (
    QueryGroup,
    decode_attention,
    gathered_numel,
    plan_groups,
    prefill_attention,
)
from pagedrl.engine.host_tensors import long_tensor
from pagedrl.engine.kv_cache import KVCache
from pagedrl.engine.reference_attention import reference_attention
from pagedrl.kernels import ops
from pagedrl.model import batch_invariant

IMPLEMENTATIONS = ("fast", "reference", "triton")
# Keys one CPU group gathers (values as many again): small enough to stay in cache until read, large
# enough that the per-call cost of the attention op is paid rarely (the sizes tried are in
# bench/RESULTS.md, "Engine").
CPU_GATHER_BYTES = 4 << 20


@dataclass
class PagedAttention:
    """Attention metadata for one engine step over a flattened batch of S sequences, N new tokens.

    slot_mapping [N]: cache slot (block * block_size + offset) where each new token's K/V goes.
    query_start_loc [S+1]: cumulative new-token counts; sequence s owns rows qsl[s]:qsl[s+1].
    seq_lens [S]: tokens of each sequence after this step (cached prefix + new).
    block_tables [S, max_blocks]: physical block ids, padded with 0 past each sequence's blocks.
    positions [N]: position of each new token (what the model's rotary embedding needs).
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor | None = None
    impl: str = "fast"
    scale: float | None = None
    groups: list[QueryGroup] | None = field(default=None, repr=False)
    max_query_len: int | None = None  # the largest q_len; the triton impl sizes its grid by it
    in_place: bool = False  # a CPU step of decodes only: `ops.paged_decode` reads the blocks where they lie
    # Batch-invariant mode: each new token's key count, for the row kernel, and its sequence (row_seqs
    # None: row r is sequence r). None: the other paths.
    row_lens: torch.Tensor | None = field(default=None, repr=False)
    row_seqs: torch.Tensor | None = field(default=None, repr=False)
    kernels: bool = False  # the CPU kernels serve this cache: its KV writes take one `store_kv` call a layer
    tiles: bool = False  # a CPU step with prompt chunks: `ops.paged_prefill` attends them in tiles
    # The dtype the model's queries come in (`from_block_tables`): float32 over a bf16 cache is attended as
    # float32 by the CPU kernels (`_widens`); None or another dtype: queries meet the cache in its dtype.
    queries: torch.dtype | None = None
    # Per-layer rules (Gemma, `model/gemma.py`; gpt-oss; a uniform window): each layer's sliding window (None:
    # every cached key) and a tanh cap on the scores. A layer with either (or sinks) attends through
    # `layer_rules`: the row or Triton kernel, which honour them, never the tiles, groups or decode program.
    windows: tuple[int | None, ...] | None = None
    softcap: float | None = None
    rule_rows: tuple[torch.Tensor, torch.Tensor | None] | None = field(default=None, repr=False)
    # Layers in groups with block tables of their own (`kv_cache_groups`): each layer's group's metadata
    # (its tables and slots), which takes this one's rules and scale when the layer attends. None: one
    # table serves every layer.
    layer_metas: tuple[PagedAttention, ...] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        kv_cache: KVCache,
        block_size: int,
        seqs: list[tuple[list[int], int, int]],
        device: torch.device | str | None = None,
        impl: str = "fast",
        scale: float | None = None,
        prefill_rows: bool = False,
        queries: torch.dtype | None = None,
    ) -> PagedAttention:
        """Metadata for sequences given as (block_table, num_computed_tokens, num_new_tokens): the
        first num_computed tokens are in the cache already, the next num_new are this step's rows.
        The block table must cover all num_computed + num_new tokens. `prefill_rows` and `queries`: as
        `from_block_tables` takes them."""
        if block_size != kv_cache.block_size:
            raise ValueError(f"block_size ({block_size}) differs from the cache's ({kv_cache.block_size})")
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        if not seqs:
            raise ValueError("seqs: the batch has no sequences")
        device = kv_cache.device if device is None else torch.device(device)
        q_lens, seq_lens, tables = [], [], []
        for i, (table, computed, new) in enumerate(seqs):
            if not isinstance(new, int) or new < 1:
                raise ValueError(f"seqs[{i}]: num_new_tokens must be a positive integer, got {new!r}")
            if not isinstance(computed, int) or computed < 0:
                raise ValueError(f"seqs[{i}]: num_computed_tokens must be a non-negative integer, got {computed!r}")
            total = computed + new
            need = -(-total // block_size)
            if len(table) < need:
                raise ValueError(f"seqs[{i}]: block_table has {len(table)} blocks, {total} tokens need {need}")
            q_lens.append(new)
            seq_lens.append(total)
            tables.append(table if len(table) == need else table[:need])
        # The tables padded with block 0 into one tensor, filled from one flat list (no per-row padding).
        flat = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.long)
        if int(flat.min()) < 0 or int(flat.max()) >= kv_cache.num_blocks:
            i = next(i for i, t in enumerate(tables) if min(t) < 0 or max(t) >= kv_cache.num_blocks)
            raise ValueError(f"seqs[{i}]: block_table holds ids outside [0, {kv_cache.num_blocks}): "
                             f"{[int(b) for b in tables[i]]}")
        num_table_blocks = torch.tensor([len(t) for t in tables])
        block_tables = torch.zeros(len(seqs), int(num_table_blocks.max()), dtype=torch.long)
        block_tables[torch.arange(block_tables.shape[1]) < num_table_blocks[:, None]] = flat
        return cls.from_block_tables(kv_cache, block_tables, q_lens, seq_lens, device, impl, scale,
                                     prefill_rows=prefill_rows, queries=queries)

    @classmethod
    def from_block_tables(
        cls,
        kv_cache: KVCache,
        block_tables: torch.Tensor,
        q_lens: list[int],
        seq_lens: list[int],
        device: torch.device | str | None = None,
        impl: str = "fast",
        scale: float | None = None,
        read_in_place: bool = True,
        rows: bool | None = None,
        prefill_rows: bool = False,
        queries: torch.dtype | None = None,
    ) -> PagedAttention:
        """Metadata from block tables already in a tensor (CPU, [S, >= the blocks each sequence
        needs], padded with block 0), as the engine's persistent block table hands them over:
        sequence s has q_lens[s] new tokens and seq_lens[s] tokens in all. Nothing is checked but
        the slots' uniqueness; `build` checks its lists first and then comes here. `read_in_place`
        False keeps a CPU decode step on the gather path (see the engine's runner). `rows`: every new
        token attended alone by the row kernel, as batch-invariant mode needs (None: whether that mode
        is on here). `prefill_rows`: a step with prompt chunks goes to the CPU kernels too (where they
        are the faster prefill: `prefill_by_rows`), to the prefill tiles where they are built for the
        cache (`prefill_in_tiles`), else to the row kernel; steps of decodes keep the in-place decode kernel.
        `queries`: the dtype the model's queries come in (None: the cache's; float32 over a bf16 cache
        takes the float32 tiles)."""
        device = kv_cache.device if device is None else torch.device(device)
        block_size = kv_cache.block_size
        num_seqs = len(q_lens)
        seq_lens_t = long_tensor(seq_lens)
        max_query_len = max(q_lens)
        if max_query_len == 1:  # every sequence decodes: row s is sequence s, at its last position
            num_rows = num_seqs
            query_start_loc = torch.arange(num_seqs + 1)
            positions = seq_lens_t - 1
            blocks = block_tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
        else:
            q_lens_t = long_tensor(q_lens)
            query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long)
            torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
            seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
            num_rows = int(query_start_loc[-1])
            positions = torch.arange(num_rows) + (seq_lens_t - q_lens_t - query_start_loc[:-1])[seq_of_row]
            blocks = block_tables[seq_of_row, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size
        if torch.unique(slot_mapping).numel() != num_rows:
            raise ValueError("seqs: two new tokens map to the same cache slot (a shared block written "
                             "without copy-on-write?)")
        groups = row_lens = row_seqs = None
        fast_here = impl == "fast" and reads_in_place(kv_cache, device)
        invariant = batch_invariant.active() if rows is None else rows
        prompts = prefill_rows and max_query_len > 1
        tiles = prompts and not invariant and fast_here and prefill_in_tiles(kv_cache, queries)
        by_rows = invariant or (prompts and not tiles)
        if by_rows and fast_here:
            row_lens = (positions + 1).to(device)
            row_seqs = None if max_query_len == 1 else seq_of_row.to(device)
        in_place = row_lens is None and read_in_place and max_query_len == 1 and fast_here
        if impl == "fast" and row_lens is None and not in_place and not tiles:
            groups = plan_groups(q_lens, seq_lens, block_tables, block_size, device, kv_cache.dtype,
                                 chunk_tokens_for(kv_cache, device), query_start_loc)
        return cls(kv_cache, slot_mapping.to(device), query_start_loc.to(device), seq_lens_t.to(device),
                   block_tables.to(device), positions.to(device), impl, scale, groups, max_query_len, in_place,
                   row_lens, row_seqs, fast_here, tiles, queries)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, N, Hq, D], k and v [1, N, Hkv, D] for this step's new tokens → [1, N, Hq, D]; `sinks`:
        as `AttentionMetadata.attend`."""
        if self.layer_metas is not None:  # the layer's group's tables, under this step's rules
            group = self.layer_metas[layer]
            group.windows, group.softcap, group.scale = self.windows, self.softcap, self.scale
            return group.attend(layer, q, k, v, sinks)
        key_cache, value_cache = self.kv_cache.key_cache[layer], self.kv_cache.value_cache[layer]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        num_rows = self.slot_mapping.shape[0]
        if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != num_rows:
            raise ValueError(f"q must have shape [1, {num_rows}, Hq, D] (one flattened row), got {tuple(q.shape)}")
        expected_kv = (1, num_rows, num_kv_heads, head_dim)
        if tuple(k.shape) != expected_kv or tuple(v.shape) != expected_kv:
            raise ValueError(f"k and v must have shape {expected_kv}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if q.shape[3] != head_dim or q.shape[2] % num_kv_heads:
            raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of the cache's kv heads "
                             f"({num_kv_heads}) and head_dim must be {head_dim}; got {tuple(q.shape)}")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
        window = self.windows[layer] if self.windows is not None else None
        rules = window is not None or self.softcap is not None or sinks is not None
        queries = q[0] if self._widens(q, key_cache, rules) else q[0].to(key_cache.dtype)
        if rules:
            return layer_rules.attend_with_rules(self, layer, queries, k, v, scale, window, sinks).to(q.dtype)[None]
        if self.impl == "triton":
            from pagedrl.engine import triton_attention

            triton_attention.store_kv(k[0], v[0], key_cache, value_cache, self.slot_mapping)
            max_query_len = self.max_query_len
            if max_query_len is None:  # metadata built by hand: one host read, kept
                max_query_len = self.max_query_len = int(self.query_start_loc.diff().max())
            out = triton_attention.paged_attention(queries, key_cache, value_cache, self.block_tables,
                                                   self.seq_lens, self.query_start_loc, max_query_len, scale)
            return out.to(q.dtype)[None]
        self._store(k, v, key_cache, value_cache)
        if self.impl == "reference":
            out = self._attend_reference(queries, key_cache, value_cache, scale)
        elif self.impl == "fast":
            out = self._attend_fast(queries, key_cache, value_cache, scale)
        else:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {self.impl!r}")
        return out.to(q.dtype)[None]

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                      expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                      absorbed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Multi-head latent attention (`model/mla.py`) on a cache of latents: `engine/latent_attention.py`."""
        return latent_attention.attend_latent(self, layer, q, latent, expand, absorbed)

    def _widens(self, q: torch.Tensor, key_cache: torch.Tensor, rules: bool) -> bool:
        """Whether this layer's float32 queries attend over a bf16 cache as they are (`kv_cache_dtype`):
        the CPU kernels read bf16 keys and values widened to float32, so the arithmetic stays the float32
        engine's over the cache's rounded values. The other paths (the gather-then-SDPA groups, Triton,
        the reference loop) attend in the cache's dtype, queries converted."""
        if q.dtype != torch.float32 or key_cache.dtype != torch.bfloat16 or self.impl != "fast" or not self.kernels:
            return False
        if self.queries != torch.float32:  # an autocast engine's bf16 queries (a float32 rope's among them)
            return False
        return rules or self.in_place or self.tiles or self.row_lens is not None

    def _store(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """The new tokens' keys and values into their cache slots."""
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        if self.kernels:  # float32 keys into a bf16 cache: rounded by the kernel as it stores them
            keys, values = k[0], v[0]
            if not (keys.dtype == values.dtype == torch.float32 and key_cache.dtype == torch.bfloat16):
                keys, values = keys.to(key_cache.dtype), values.to(value_cache.dtype)
            ops.store_kv(keys, values, key_cache, value_cache, self.slot_mapping)
        else:
            key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, k[0].to(key_cache.dtype))
            value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping,
                                                                     v[0].to(value_cache.dtype))

    def _attend_reference(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          scale: float) -> torch.Tensor:
        return reference_attention(q, key_cache, value_cache, self.seq_lens, self.query_start_loc, self.block_tables,
                                   scale)

    def _attend_fast(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     scale: float) -> torch.Tensor:
        if self.row_lens is not None:  # each new token's row alone, over its positions up to its own
            return ops.paged_attention(q, key_cache, value_cache, self.block_tables, self.row_lens, scale,
                                               self.row_seqs)[0]
        if self.tiles:  # prompt chunks: a sequence's consecutive rows together
            return ops.paged_prefill(q, key_cache, value_cache, self.block_tables, self.query_start_loc,
                                             self.seq_lens, scale)
        if self.in_place:
            return ops.paged_decode(q, key_cache, value_cache, self.block_tables, self.seq_lens, scale)
        if self.groups is None:  # metadata built by hand rather than by `build`: plan once, keep it
            self.groups = plan_groups(self.query_start_loc.diff().tolist(), self.seq_lens.tolist(),
                                      self.block_tables.cpu(), key_cache.shape[1], q.device, key_cache.dtype,
                                      chunk_tokens_for(self.kv_cache, q.device))
        scratch = self.kv_cache.scratch(max(gathered_numel(key_cache, g) for g in self.groups))
        out = None
        for group in self.groups:
            op = decode_attention if group.is_decode else prefill_attention
            part = op(q, key_cache, value_cache, group, scale, scratch)
            if group.out_rows is None:  # the only group, rows in order
                return part
            out = part.new_empty(q.shape) if out is None else out  # part's dtype: autocast may lower it
            out.index_copy_(0, group.out_rows, part)
        assert out is not None
        return out


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """`auto`: the Triton kernels on CUDA, the gather-then-SDPA fast path elsewhere (a CPU cannot run
    Triton kernels outside the interpreter, and the fast path is tuned for its caches)."""
    if impl == "auto":
        return "triton" if torch.device(device).type == "cuda" else "fast"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be 'auto' or one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


def uniform_windows(model: torch.nn.Module) -> tuple[int, ...] | None:
    """Each layer's window for a model whose layers all slide over one (`ModelConfig.uniform_window`),
    as the metadata's `windows` carries Gemma's; None for the others (Gemma and gpt-oss attach theirs)."""
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "uniform_window", None)
    return None if window is None else (window,) * cfg.num_hidden_layers


def reads_in_place(kv_cache: KVCache, device: torch.device) -> bool:
    """Whether a CPU decode step runs the in-place kernel (`kernels/ops.py`): float32 or bf16, built."""
    return device.type == "cpu" and kv_cache.dtype in (torch.float32, torch.bfloat16) and ops.available()


def prefill_by_rows(kv_cache: KVCache, device: torch.device) -> bool:
    """Whether a CPU step with prompt chunks goes to the CPU kernels (the prefill tiles where
    `prefill_in_tiles`, else each new token's row through the row kernel, `ops.paged_attention`:
    one pass over the keys each row sees, read where they lie) rather than gather + torch's flash
    attention: on a CPU without AMX, in bf16 (64 prompts of 32-512 tokens, attention of their prefill:
    rows 3.6 s, tiles 1.2 s, flash attention 6.3 s) and in float32 (one layer of the same prompts,
    two threads, tiles / rows / flash attention: AVX512 66 / 102 / 160 ms; as AVX2 70 / 106 / 162;
    `bench/RESULTS.md`). With AMX torch's flash attention is the faster in bf16
    (5.0-5.7 s against 7.3-7.5 s for the whole prefill through rows), and float32 there was not
    measured: both keep it."""
    return reads_in_place(kv_cache, device) and not ops.decode_linear_amx()


def prefill_in_tiles(kv_cache: KVCache, queries: torch.dtype | None = None) -> bool:
    """Whether prompt chunks that go to the CPU kernels take the prefill tiles (`csrc/prefill_tiles.cpp`:
    a prompt's rows 16 at a time against each chunk of keys laid out once): a cache of a head size the
    kernel is built for, in bf16 with the bf16 dot-product instructions (64 prompts of 32-512 tokens,
    one layer, two threads: 35-38 ms against the row kernel's 75), or in float32 with AVX2 and FMA or
    AVX512 (`csrc/prefill_tiles_f32.h`: 66 against 102 on AVX512, 70 against 106 as AVX2;
    `bench/RESULTS.md`). Batch-invariant steps keep the row kernel. Float32 `queries` over a bf16 cache
    (`kv_cache_dtype`) take the float32 tiles, which widen the cache's keys and values as they read them."""
    if kv_cache.head_dim not in ops.PREFILL_HEAD_DIMS:
        return False
    if kv_cache.dtype == torch.float32 or queries == torch.float32:
        return ops.paged_prefill_float32()
    return kv_cache.dtype == torch.bfloat16 and ops.decode_linear_available()


def chunk_tokens_for(kv_cache: KVCache, device: torch.device) -> int | None:
    """Key positions one CPU group may gather (CPU_GATHER_BYTES of keys); None on other devices."""
    if device.type != "cpu":
        return None
    per_token = kv_cache.num_kv_heads * kv_cache.head_dim * kv_cache.data.element_size()
    return max(kv_cache.block_size, CPU_GATHER_BYTES // per_token)
