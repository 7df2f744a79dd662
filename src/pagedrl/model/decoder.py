"""The Llama-family decoder, top to bottom as in the papers: embed, N × (RMSNorm → attention with
RoPE and GQA → residual → RMSNorm → SwiGLU, or a sparse mixture of SwiGLU experts (`model/moe.py`)
where the config routes that layer → residual), RMSNorm, LM head.

Module names match Hugging Face's so a checkpoint's state dict loads with no renaming. Attention is
delegated to an explicit metadata object (`pagedrl.model.attention`), which is how the same weights
serve dense training batches and the paged engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model import batch_invariant, routed
from pagedrl.model.attention import AttentionMetadata, DenseAttention
from pagedrl.model.config import ModelConfig
from pagedrl.model.fused import FusedAttention, FusedMLP
from pagedrl.model.moe import SparseMoeBlock
from pagedrl.model.rope import longrope_of, rope_cos_sin, rope_inv_freq, rotate
from pagedrl.model.routed import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = routed.current()
        if routes is not None:
            out = routes.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # Qwen2 puts bias on q/k/v only; Llama's attention_bias also covers o_proj.
        o_bias = bias and cfg.model_type != "qwen2"
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, k, cos, sin)
        out = meta.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = routed.current()
        if (routes is not None and routes.gate_up is not None and type(self.gate_proj) is Linear
                and type(self.up_proj) is Linear and self.gate_proj.bias is None and self.up_proj.bias is None):
            hidden = routes.gate_up(x, self.gate_proj.weight, self.up_proj.weight)  # (an adapter's layer: not taken)
            if hidden is not None:
                return self.down_proj(hidden)
        gate, up = self.gate_proj(x), self.up_proj(x)
        fused = routes.silu_mul(gate, up) if routes is not None else None
        return self.down_proj(fused if fused is not None else F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = FusedAttention(cfg, layer) if cfg.fused_projections else Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock | FusedMLP = (
            SparseMoeBlock(cfg) if cfg.sparse_layer(layer) else FusedMLP(cfg) if cfg.fused_projections else MLP(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm: everything but the head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.longrope = longrope_of(cfg.rope_scaling, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", rope_inv_freq(*self.rope), persistent=False)
        self.gradient_checkpointing = False

    # Batch-invariant matmuls and attention in every forward (`model/batch_invariant.py`): set on a
    # policy whose rollouts must carry the trainer's own bits.
    batch_invariant = False

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """`.to(torch.bfloat16)` casts every buffer; the rotary frequencies stay float32 (in bf16
        each is off by up to 0.2%, which at position 1000 turns the fastest pair by up to 2 radians)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(*self.rope).to(self.inv_freq.device)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with batch_invariant.scope(self.batch_invariant):
            x = self.embed_tokens(input_ids)
            cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype, self.longrope)
            for layer in self.layers:
                if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    x = torch.utils.checkpoint.checkpoint(batch_invariant.scoped(layer, self.batch_invariant),
                                                          x, cos, sin, meta, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, meta)
            return self.norm(x)


class CausalLM(nn.Module):
    """Backbone + LM head. `forward` returns hidden states; `logits` projects only the rows asked
    for, so training and sampling never pay for vocabulary projections they do not use."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] → hidden [B, T, hidden]. Without `meta`, dense causal attention over
        `attention_mask` (padding on either side), positions counted over real tokens."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if positions is None:
            positions = default_positions(input_ids, attention_mask)
        if positions.dim() == 1:
            positions = positions[None]
        if meta is None:
            meta = DenseAttention.causal(attention_mask, self.config.sliding_window,
                                         seq_len=input_ids.shape[1], device=input_ids.device)
        return self.model(input_ids, positions, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with batch_invariant.scope(self.model.batch_invariant):
            return self.lm_head(hidden).float()

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The precision the model computes in: its final norm's (a quantized model's projections hold
        GGUF blocks, not floats)."""
        return self.model.norm.weight.dtype


def default_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions 0.. over real tokens (left padding shifts them), as transformers computes them."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
