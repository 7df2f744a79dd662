"""Attention and feed-forward with fused projections, as Phi-3 (`Phi3ForCausalLM`) holds them.

Phi-3's checkpoints hold one `qkv_proj` (the query rows, then the key rows, then the value rows) and
one `gate_up_proj` (the gate rows, then the up rows) per layer. They stay fused in memory: one product
where the Llama layout makes three and two, the state dict's names are the checkpoint's (transformers
loads what pagedrl saves with no renaming), and a LoRA adapter targets `qkv_proj` and `gate_up_proj`
as PEFT does on transformers' Phi-3, so adapters pass between the two unchanged. What follows each
product is the Llama decoder's (`model/decoder.py`): rotary embedding (partial when the config says),
the engine's attention, SiLU(gate) * up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model import routed
from pagedrl.model.attention import AttentionMetadata
from pagedrl.model.config import ModelConfig
from pagedrl.model.rope import rotate
from pagedrl.model.routed import Linear


class FusedAttention(nn.Module):
    """Multi-head attention with GQA whose q, k and v come from one `qkv_proj` product (no bias)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q, kv, kv)
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = None  # as the Llama attention without q/k norms

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, k, cos, sin)
        out = meta.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class FusedMLP(nn.Module):
    """down(SiLU(gate) * up) with gate and up the two halves of one `gate_up_proj` product (no bias)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        routes = routed.current()
        fused = routes.silu_mul(gate, up) if routes is not None else None  # (declined: the halves are views)
        return self.down_proj(fused if fused is not None else F.silu(gate) * up)
