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
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] for the new tokens. Returns [B, T, Hq, D]. `sinks`
        [Hq] (gpt-oss): a logit per head that joins each query's softmax and is dropped after it."""
        ...


@dataclass
class DenseAttention:
    """Attention over the batch's own tokens. `mask` is boolean [B, T, T] (True = may attend), or
    None for plain causal attention over unpadded rows."""

    mask: torch.Tensor | None = None
    scale: float | None = None
    # Batch-invariant mode's tables of the keys each row sees, made once per batch shape: (B, T, tables).
    key_tables: Any = field(default=None, repr=False, compare=False)
    # Per-layer rules (Gemma, `model/gemma.py`; gpt-oss's windows): each layer's sliding window (None: all keys), the
    # positions the windows are measured in ([B, T]), and a tanh cap on the scores.
    windows: tuple[int | None, ...] | None = None
    key_positions: torch.Tensor | None = field(default=None, repr=False, compare=False)
    softcap: float | None = None
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

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

    def layer_mask(self, layer: int, T: int, device: torch.device) -> torch.Tensor | None:
        """The mask of `layer`: the batch's, narrowed to the layer's window when it has one (by
        position, so packed segments and padded rows are measured as transformers measures them)."""
        window = self.windows[layer] if self.windows is not None else None
        if window is None:
            return self.mask
        if window not in self._window_masks:
            if self.key_positions is None:
                raise ValueError("a sliding-window layer needs the tokens' positions (key_positions)")
            pos = self.key_positions
            near = (pos[:, :, None] - pos[:, None, :]) < window
            idx = torch.arange(T, device=device)
            base = self.mask if self.mask is not None else (idx[None, :] <= idx[:, None])[None]
            self._window_masks[window] = (base if base.dim() == 3 else base[:, 0]) & near
        return self._window_masks[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.windows is not None or self.softcap is not None or sinks is not None:
            return self._attend_with_rules(layer, q, k, v, sinks)
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

    def _attend_with_rules(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Per-layer windows, soft-capped scores and sinks, spelled out as transformers' eager attention
        computes them (a fused kernel has neither a tanh cap nor a sink column); the softmax in float32."""
        if batch_invariant.active():
            raise NotImplementedError("batch-invariant attention with per-layer sliding windows or sinks "
                                      "(Gemma, gpt-oss) is not implemented")
        B, T = q.shape[:2]
        mask = self.layer_mask(layer, T, q.device)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        groups = qh.shape[1] // kh.shape[1]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        mask = mask if mask is None or mask.dim() == 4 else mask[:, None]
        if self.softcap is None and sinks is None:  # windows only: the fused kernel takes the mask
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale)
            return out.transpose(1, 2)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(qh, kh.transpose(2, 3)) * scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            idx = torch.arange(T, device=q.device)
            mask = (idx[None, :] <= idx[:, None])[None, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per head, in the softmax and not after it
            column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        else:
            probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, vh).transpose(1, 2)
