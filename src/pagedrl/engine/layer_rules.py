"""Attention under a layer's rules: a sliding window (Mistral v0.1, Qwen2 with `use_sliding_window`,
Phi-3-mini, Gemma's and gpt-oss's sliding layers), soft-capped scores (Gemma 2), attention sinks (gpt-oss).

Which kernel honours them: on a GPU the Triton kernel (`triton_attention.paged_attention` takes all three);
on a CPU the row kernel (`ops.paged_attention`), one query row at a time, for decode steps, and the
prefill tiles (`ops.paged_prefill`) for a step's prompt chunks where they run; the other fast
variants (the gather-then-SDPA groups, the decode program's call without a window) know none of them,
so a layer with a rule never goes there. Each of these
starts a row's loop at the window's first key, so a windowed layer's cost stays O(window) however long
the sequence, and the blocks below every window can be freed (`kv_cache_manager`) without a kernel reading
them. Where neither kernel runs (another dtype or device, the kernels not built, `impl="reference"`) the
layer takes `reference_attention`, which applies them too. Never a kernel that would ignore a rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedrl.engine.reference_attention import reference_attention
from pagedrl.kernels import ops

if TYPE_CHECKING:
    from pagedrl.engine.attention import PagedAttention


def attend_with_rules(meta: PagedAttention, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [N, Hq, D] in the cache's dtype, k and v [1, N, Hkv, D] → [N, Hq, D]: the new keys and values
    stored, then each row attended under the layer's rules by the fastest path that honours them."""
    key_cache, value_cache = meta.kv_cache.key_cache[layer], meta.kv_cache.value_cache[layer]
    if meta.impl == "triton":
        from pagedrl.engine import triton_attention

        triton_attention.store_kv(k[0], v[0], key_cache, value_cache, meta.slot_mapping)
        max_query_len = meta.max_query_len
        if max_query_len is None:
            max_query_len = meta.max_query_len = int(meta.query_start_loc.diff().max())
        return triton_attention.paged_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                                meta.query_start_loc, max_query_len, scale, window=window,
                                                softcap=meta.softcap, sinks=sinks)
    meta._store(k, v, key_cache, value_cache)
    sink_logits = None if sinks is None else sinks.detach().float()
    if meta.impl == "fast" and meta.tiles:  # a step with prompt chunks: a prompt's rows in tiles
        return ops.paged_prefill(q, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                 scale, window=window, softcap=meta.softcap, sinks=sink_logits)
    if meta.impl == "fast" and meta.kernels:
        row_lens, row_seqs = kernel_rows(meta)
        return ops.paged_attention(q, key_cache, value_cache, meta.block_tables, row_lens, scale, row_seqs,
                                   window=window, softcap=meta.softcap, sinks=sink_logits)[0]
    return reference_attention(q, key_cache, value_cache, meta.seq_lens, meta.query_start_loc, meta.block_tables,
                               scale, window, meta.softcap, sinks)


def kernel_rows(meta: PagedAttention) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each new token's key count and sequence as the row kernel takes them (row_seqs None: row s is
    sequence s, a step of decodes), made once per step's metadata and kept for the other layers."""
    if meta.row_lens is not None:
        return meta.row_lens, meta.row_seqs
    if meta.rule_rows is None:
        num_seqs = meta.seq_lens.shape[0]
        if meta.slot_mapping.shape[0] == num_seqs and meta.max_query_len == 1:
            meta.rule_rows = (meta.seq_lens, None)
        else:
            q_lens = meta.query_start_loc.diff()
            positions = meta.positions
            if positions is None:  # metadata built by hand: the positions from the lengths
                seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=q_lens.device), q_lens)
                positions = (torch.arange(seq_of_row.shape[0], device=q_lens.device)
                             + (meta.seq_lens - q_lens - meta.query_start_loc[:-1])[seq_of_row])
            meta.rule_rows = (positions + 1, torch.repeat_interleave(
                torch.arange(num_seqs, device=q_lens.device), q_lens))
    return meta.rule_rows
