"""Multi-head latent attention (DeepSeek-V3, `model/mla.py`) on a paged cache of latents.

The cache (`KVCache(values=False)`) holds per token and layer one latent: the normed `kv_lora_rank`
features and the rotated `qk_rope_head_dim` shared key part, W numbers in all, in the blocks and block
tables every family uses. Two ways to attend over it:

- folded (`attend_latent` with the layer's `absorbed` weights, any impl but `reference`): as vLLM's
  MLA backend does, kv_b_proj is folded into the queries. Each head's unrotated query becomes
  q_nope W_UK (kv_lora_rank wide), so its score against a latent c is q_nope · (W_UK c); the latents
  are then the keys of one KV head, their first kv_lora_rank features its values, attended by the
  paths every family takes (`PagedAttention.attend`: the CPU kernels, the Triton kernels), and each
  head's result is turned back by W_UV. Nothing is up-projected per cached token, so a decode step's
  cost grows with the context as one head's attention does (bench/bench_mla_decode.py).
- expanded (`latent_attention`: the `reference` impl, and a layer whose kv_b_proj carries an adapter
  or quantized weights): every cached latent of the step's sequences up-projected through the layer's
  `expand` (its kv_b_proj module), then attended one sequence at a time in float32, in transformers'
  order of operations: the oracle the folded path is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedrl.engine.attention import PagedAttention


def attend_latent(meta: PagedAttention, layer: int, q: torch.Tensor, latent: torch.Tensor,
                  expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  absorbed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """q [1, N, H, Dk] and latent [1, N, W] of a step's new tokens → [1, N, H, Dv]; the latents are
    written to their slots either way. `absorbed`: kv_b_proj's key rows [H, Dnope, R] and value rows
    [H, Dv, R] (None: expand)."""
    cache = meta.kv_cache.key_cache[layer]
    if meta.kv_cache.values or latent.shape[0] != 1 or latent.shape[-1] != cache.shape[-1]:
        raise ValueError(f"attend_latent needs a cache of latents of width {latent.shape[-1]}, got {meta.kv_cache}")
    if absorbed is not None and meta.impl != "reference":
        keys, values = absorbed
        nope, rank = keys.shape[1], keys.shape[2]
        # per head: [N, Dnope] @ [Dnope, R], one batched product over the heads
        q_latent = torch.matmul(q[0, :, :, :nope].transpose(0, 1), keys.to(q.dtype)).transpose(0, 1)
        as_kv = latent[:, :, None]  # one KV head; its values are the keys' first `rank` features
        out = meta.attend(layer, torch.cat((q_latent, q[0, :, :, nope:]), dim=-1)[None], as_kv, as_kv)
        per_head = out[0, :, :, :rank].transpose(0, 1)  # [H, N, R]
        return torch.matmul(per_head, values.to(out.dtype).transpose(1, 2)).transpose(0, 1)[None]
    cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent[0].to(cache.dtype))
    scale = meta.scale if meta.scale is not None else q.shape[-1] ** -0.5
    out = latent_attention(q[0], cache, expand, meta.seq_lens, meta.query_start_loc, meta.block_tables, scale)
    return out.to(q.dtype)[None]


def latent_attention(q: torch.Tensor, latent_cache: torch.Tensor,
                     expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-head latent attention over a cache of latents (`model/mla.py`): q [N, H, Dk] of a step's
    new tokens → [N, H, Dv]. Every sequence's cached latents [keys, 1, W] are read through its block
    table, all of the step's in one gather, and up-projected by `expand` (the layer's `kv_b_proj`, an
    adapter on it included) in one call into keys [keys, H, Dk] and values [keys, H, Dv]; then each
    sequence's queries attend causally over its own, in float32 as `reference_attention` does."""
    block_size, width = latent_cache.shape[1], latent_cache.shape[-1]
    flat = latent_cache.reshape(-1, width)
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    positions = [torch.arange(n, device=q.device) for n in lens]
    slots = torch.cat([block_tables[s, pos // block_size] * block_size + pos % block_size
                       for s, pos in enumerate(positions)])
    keys, values = expand(flat[slots])
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
    offset = 0
    for s, (seq_len, key_pos) in enumerate(zip(lens, positions, strict=True)):
        first, last = starts[s], starts[s + 1]
        k, v = keys[offset:offset + seq_len].float(), values[offset:offset + seq_len].float()
        scores = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * scale
        query_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)[:, None]
        scores = scores.masked_fill(key_pos[None, :] > query_pos, float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
        offset += seq_len
    return out
