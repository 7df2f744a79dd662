"""The attention half of batch-invariant computation (`model/batch_invariant.py`): each query row
attended alone by the engine's row kernel (`kernels/ops.paged_attention`), its keys taken 16
positions at a time from wherever they lie, forward and backward. The engine reads them from the KV
cache's blocks, a trainer from its packed batch through a table of the tokens each row sees, so a
decoded token and the trainer's recompute of it get the same bits."""

from __future__ import annotations

import torch

KeyTables = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def visible_key_tables(mask: torch.Tensor | None, batch: int, seq_len: int) -> KeyTables:
    """From a dense attention mask (boolean [B, T, T], True = may attend; None = causal), where the
    kernel finds the keys each query row sees, in column order (= position order in a packed or
    padded batch), as indices into the batch flattened to B*T rows: (tables, lengths [B*T],
    row_seqs). Causal: one table per batch row, row_seqs naming it. Masked: one table per query row
    [B*T, most keys any row sees], row_seqs None."""
    if mask is None:
        tables = torch.arange(batch * seq_len).view(batch, seq_len)
        lengths = torch.arange(1, seq_len + 1).repeat(batch)
        return tables, lengths, torch.arange(batch).repeat_interleave(seq_len)
    mask = mask.expand(batch, seq_len, seq_len).cpu()
    lengths = mask.sum(-1).reshape(-1)
    where = mask.reshape(batch * seq_len, seq_len).nonzero()  # (row, key column), rows in order, keys ascending
    rank = torch.arange(where.shape[0]) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    tables = torch.zeros(batch * seq_len, int(lengths.max()), dtype=torch.long)
    tables[where[:, 0], rank] = where[:, 1] + (where[:, 0] // seq_len) * seq_len
    return tables, lengths, None


class _RowAttention(torch.autograd.Function):
    """Forward and backward by the row kernel: each row visits only the keys it sees (a dense
    backward over a packed batch of groups walked every pair of tokens, most of them masked, and
    was a quarter of a GRPO training pass)."""

    @staticmethod
    def forward(ctx, q, k, v, tables, lengths, row_seqs, scale):  # type: ignore[no-untyped-def]
        from pagedrl.kernels import ops

        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        rows, keys, values = q.reshape(B * T, Hq, D), k.reshape(B * T, 1, Hkv, D), v.reshape(B * T, 1, Hkv, D)
        out, lse = ops.paged_attention(rows, keys, values, tables, lengths, scale, row_seqs, with_lse=True)
        ctx.save_for_backward(rows, keys, values, out, lse, tables, lengths, row_seqs)
        ctx.scale, ctx.shapes = scale, (q.shape, k.shape)
        return out.view(B, T, Hq, D)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        from pagedrl.kernels import ops

        rows, keys, values, out, lse, tables, lengths, row_seqs = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        dq, dk, dv = ops.paged_attention_backward(grad_out.reshape(rows.shape), rows, keys, values, out, lse,
                                                          tables, lengths, ctx.scale, row_seqs)
        return dq.view(q_shape), dk.view(k_shape), dv.view(k_shape), None, None, None, None


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float | None, tables: KeyTables | None = None) -> torch.Tensor:
    """Dense attention (q [B, T, Hq, D], k and v [B, T, Hkv, D], `mask` as `DenseAttention`'s)
    computed row by row as the engine's paged attention computes a decoded token, in the autocast
    dtype when one is active. `tables`: `visible_key_tables(mask, B, T)`, when the caller keeps it."""
    B, T, _, D = q.shape
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    key_tables, lengths, row_seqs = tables if tables is not None else visible_key_tables(mask, B, T)
    with torch.autocast("cpu", enabled=False):
        return _RowAttention.apply(q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(),
                                   key_tables, lengths, row_seqs, scale if scale is not None else D ** -0.5)


def attention_available(device: torch.device) -> bool:
    """Whether the row kernel runs here (a CPU where it was built)."""
    if device.type != "cpu":
        return False
    from pagedrl.kernels import ops

    return ops.available()
