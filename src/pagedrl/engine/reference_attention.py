"""Paged attention one sequence at a time, in float32, every step spelled out: the `reference`
implementation the tests hold the others to, with the rules of a sliding window, soft-capped scores
(Gemma, `model/gemma.py`) and attention sinks (gpt-oss, `model/gpt_oss.py`) the kernels are held to
there too (`engine/layer_rules.py` routes such layers to kernels that honour them, and here only where
none runs)."""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] of a step's new tokens (sequence s owns rows query_start_loc[s]:[s + 1], the last
    of its seq_lens[s] positions) → [N, Hq, D]. `window`: a query sees only the keys less than that
    many positions back (the others are not even read); `softcap`: scores become cap · tanh(s / cap);
    `sinks` [Hq]: each head's logit joins every query's softmax as one more column, dropped after it."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    groups = q.shape[1] // num_kv_heads
    flat_keys = key_cache.reshape(-1, num_kv_heads, head_dim)
    flat_values = value_cache.reshape(-1, num_kv_heads, head_dim)
    starts = query_start_loc.tolist()
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        q_len = last - first
        start = 0 if window is None else max(0, seq_len - q_len - window + 1)  # keys no query sees: skipped
        key_pos = torch.arange(start, seq_len, device=q.device)
        slots = block_tables[s, key_pos // block_size] * block_size + key_pos % block_size
        keys = flat_keys[slots].float().repeat_interleave(groups, dim=1)  # [keys, Hq, D]
        values = flat_values[slots].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        hidden = key_pos[None, :] > query_pos
        if window is not None:
            hidden |= query_pos - key_pos[None, :] >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out
