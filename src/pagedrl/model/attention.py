"""Attention metadata: how the decoder's layers attend, passed explicitly on every forward.

The decoder computes q, k, v and hands them to `meta.attend(layer, q, k, v)`; the metadata object
decides how keys and values are found. `DenseAttention` is the training path (autograd, padded or
packed batches, any boolean mask); the engine's paged metadata (`pagedrl.engine.attention`) reads
and writes a block KV cache instead. One module, one set of weights, two paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pagedrl.model import batch_invariant, row_attention


class AttentionMetadata(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] for the new tokens. Returns [B, T, Hq, D]."""
        ...


@dataclass
class DenseAttention:
    """Attention over the batch's own tokens. `mask` is boolean [B, T, T] (True = may attend), or
    None for plain causal attention over unpadded rows."""

    mask: torch.Tensor | None = None
    scale: float | None = None
    # Batch-invariant mode's tables of the keys each row sees, made once per batch shape: (B, T, tables).
    key_tables: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def causal(cls, attention_mask: torch.Tensor | None = None, sliding_window: int | None = None,
               seq_len: int | None = None, device: torch.device | None = None) -> DenseAttention:
        """Causal attention over rows padded on either side; `attention_mask` [B, T] marks real tokens."""
        if attention_mask is None and sliding_window is None:
            return cls(None)
        if attention_mask is not None:
            seq_len, device = attention_mask.shape[1], attention_mask.device
        assert seq_len is not None
        idx = torch.arange(seq_len, device=device)
        allowed = idx[None, :] <= idx[:, None]
        if sliding_window is not None:
            allowed &= idx[:, None] - idx[None, :] < sliding_window
        allowed = allowed[None]
        if attention_mask is not None:
            keep = attention_mask.bool()
            allowed = allowed & keep[:, None, :]
            # A padding query attends to itself alone so its softmax stays finite; its output is ignored.
            allowed = allowed | torch.diag_embed(~keep)
        return cls(allowed)

    @classmethod
    def segments(cls, segment_ids: torch.Tensor, parent: torch.Tensor | None = None) -> DenseAttention:
        """Packed rows: token i may attend to an earlier token j of its own segment, or of an
        ancestor segment (`parent[s]` = segment whose tokens s sees as a prefix, -1 for none).
        This is how a group's completions share one copy of their prompt."""
        seg = segment_ids
        T = seg.shape[-1]
        idx = torch.arange(T, device=seg.device)
        causal = idx[None, :] <= idx[:, None]
        visible = seg[..., :, None] == seg[..., None, :]
        if parent is not None:
            # Walk up the ancestry: a segment sees each ancestor's tokens.
            anc = seg.clone()
            for _ in range(int(parent.numel())):
                anc = torch.where(anc >= 0, parent[anc.clamp(min=0)], anc)
                if bool((anc < 0).all()):
                    break
                visible |= (anc[..., :, None] == seg[..., None, :]) & (anc[..., :, None] >= 0)
        return cls(visible & causal)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if batch_invariant.active() and row_attention.attention_available(q.device):
            B, T = q.shape[:2]
            if self.key_tables is None or self.key_tables[:2] != (B, T):
                self.key_tables = (B, T, row_attention.visible_key_tables(self.mask, B, T))
            return row_attention.row_attention(q, k, v, self.mask, self.scale, self.key_tables[2])
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        groups = qh.shape[1] // kh.shape[1]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        if self.mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            mask = self.mask if self.mask.dim() == 4 else self.mask[:, None]
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2)
