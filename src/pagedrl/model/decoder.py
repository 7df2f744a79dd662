"""The Llama-family decoder, top to bottom as in the papers: embed, N × (RMSNorm → attention with
RoPE and GQA → residual → RMSNorm → SwiGLU, or a sparse mixture of SwiGLU experts (`model/moe.py`)
where the config routes that layer → residual), RMSNorm, LM head. Gemma's rules (`model/gemma.py`) and
gpt-oss's (`model/gpt_oss.py`: attention sinks, per-layer windows) are switches on the same modules.

Module names match Hugging Face's so a checkpoint's state dict loads with no renaming. Attention is
delegated to an explicit metadata object (`pagedrl.model.attention`), which is how the same weights
serve dense training batches and the paged engine.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model import batch_invariant, gemma, gpt_oss, routed
from pagedrl.model.attention import AttentionMetadata, DenseAttention
from pagedrl.model.config import ModelConfig
from pagedrl.model.fused import FusedAttention, FusedMLP
from pagedrl.model.mla import LatentAttention
from pagedrl.model.moe import DeepseekMoE, SparseMoeBlock
from pagedrl.model.rope import longrope_of, rope_attention_factor, rope_cos_sin, rope_inv_freq, rotate
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
            self.q_norm = norm_for(cfg)(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm_for(cfg)(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a learned logit per head that joins each query's softmax (`model/gpt_oss.py`).
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.gpt_oss is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, k, cos, sin)
        out = meta.attend(self.layer, q, k, v) if self.sinks is None else meta.attend(self.layer, q, k, v, self.sinks)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        # DeepSeek's shared experts: a width of their own
        width = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.tanh_gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's gate; the fused routes are SiLU's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tanh_gelu:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        routes = routed.current()
        if (routes is not None and routes.gate_up is not None and type(self.gate_proj) is Linear
                and type(self.up_proj) is Linear and self.gate_proj.bias is None and self.up_proj.bias is None):
            hidden = routes.gate_up(x, self.gate_proj.weight, self.up_proj.weight)  # (an adapter's layer: not taken)
            if hidden is not None:
                return self.down_proj(hidden)
        gate, up = self.gate_proj(x), self.up_proj(x)
        fused = routes.silu_mul(gate, up) if routes is not None else None
        return self.down_proj(fused if fused is not None else F.silu(gate) * up)


def norm_for(cfg: ModelConfig) -> type[nn.Module]:
    """Gemma's RMSNorm scales by (1 + weight); every other family's by weight (gpt-oss's in float32)."""
    if cfg.gpt_oss is not None:
        return gpt_oss.GptOssRMSNorm
    return gemma.GemmaRMSNorm if cfg.gemma is not None else RMSNorm


def sparse_block(cfg: ModelConfig) -> SparseMoeBlock | DeepseekMoE:
    """A sparse layer's feed-forward: DeepSeek's routed and shared experts, or Mixtral's and Qwen3-MoE's."""
    if cfg.deepseek is None:
        return SparseMoeBlock(cfg)
    return DeepseekMoE(cfg, MLP(cfg, cfg.expert_intermediate_size * cfg.deepseek.n_shared_experts))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        norm = norm_for(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (FusedAttention(cfg, layer) if cfg.fused_projections
                          else LatentAttention(cfg, layer, norm) if cfg.deepseek else Attention(cfg, layer))
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock | FusedMLP | DeepseekMoE = (
            sparse_block(cfg) if cfg.sparse_layer(layer) else FusedMLP(cfg) if cfg.fused_projections else MLP(cfg))
        # Gemma: a norm on each sublayer's output too (post_attention_layernorm then norms attention's).
        self.sandwich = cfg.gemma is not None
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm: everything but the head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = norm_for(cfg)(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.longrope = longrope_of(cfg.rope_scaling, cfg.max_position_embeddings)
        self.attention_factor = rope_attention_factor(cfg.rope_scaling)
        # Latent attention's softmax scale (qk_head_dim^-1/2, yarn's mscale²), handed to whatever attends.
        self.softmax_scale = cfg.deepseek.softmax_scale if cfg.deepseek is not None else None
        self.register_buffer("inv_freq", rope_inv_freq(*self.rope), persistent=False)
        self.rules = cfg.gemma
        self.gpt_oss = cfg.gpt_oss
        # Gemma 3's sliding layers rotate by a base of their own, unscaled.
        self.local_rope = None if self.rules is None or self.rules.local_rope_theta is None else (
            cfg.head_dim, self.rules.local_rope_theta, None)
        if self.local_rope is not None:
            self.register_buffer("local_inv_freq", rope_inv_freq(*self.local_rope), persistent=False)
        self.gradient_checkpointing = False

    # Batch-invariant matmuls and attention in every forward (`model/batch_invariant.py`): set on a
    # policy whose rollouts must carry the trainer's own bits.
    batch_invariant = False

    def reset_rope(self) -> None:
        """The rotary frequencies recomputed in float32 on the CPU (after `to_empty`, which leaves them garbage)."""
        self.inv_freq = rope_inv_freq(*self.rope)
        if self.local_rope is not None:
            self.local_inv_freq = rope_inv_freq(*self.local_rope)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """`.to(torch.bfloat16)` casts every buffer; the rotary frequencies stay float32 (in bf16
        each is off by up to 0.2%, which at position 1000 turns the fastest pair by up to 2 radians)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(*self.rope).to(self.inv_freq.device)
            if self.local_rope is not None:
                self.local_inv_freq = rope_inv_freq(*self.local_rope).to(self.inv_freq.device)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with batch_invariant.scope(self.batch_invariant):
            x = self.embed_tokens(input_ids)
            cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype, self.longrope, self.attention_factor)
            if self.softmax_scale is not None and hasattr(meta, "scale"):
                meta = dataclasses.replace(meta, scale=self.softmax_scale)
            ropes = [(cos, sin)] * len(self.layers)
            if self.gpt_oss is not None:
                meta = gpt_oss.with_layer_windows(meta, self.gpt_oss, positions)
            if self.rules is not None:
                x = gemma.embed_scale(x, x.shape[-1])
                meta = gemma.with_layer_rules(meta, self.rules, positions)
                if self.local_rope is not None:
                    local = rope_cos_sin(positions, self.local_inv_freq, x.dtype)
                    ropes = [local if kind == gemma.SLIDING else (cos, sin) for kind in self.rules.layer_types]
            for layer, (cos, sin) in zip(self.layers, ropes, strict=True):
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

    def logits(self, hidden: torch.Tensor, float32_out: bool = False) -> torch.Tensor:
        """The LM head's logits in float32. `float32_out`: under autocast the product's operands are rounded
        to the autocast dtype but the product itself is accumulated and returned in float32 (TRL's
        `_project`), where the plain path returns the autocast dtype's rounded logits, widened after."""
        with batch_invariant.scope(self.model.batch_invariant):
            if float32_out and type(self.lm_head) is Linear and self.lm_head.weight.is_floating_point():
                logits = float32_product(hidden, self.lm_head.weight)
            else:
                logits = self.lm_head(hidden).float()
        return gemma.soft_cap(logits, self.config.gemma.final_logit_softcapping) if self.config.gemma else logits

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The precision the model computes in: its final norm's (a quantized model's projections hold
        GGUF blocks, not floats)."""
        return self.model.norm.weight.dtype


def float32_product(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weightᵀ with float32 output from operands in the precision the run computes in (the autocast
    dtype when autocast is on, else the weight's): no rounding of the result to bfloat16."""
    kind = hidden.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    wide = torch.promote_types(dtype, torch.float32)  # float64 stays float64
    with torch.autocast(kind, enabled=False):
        return F.linear(hidden.to(dtype).to(wide), weight.to(dtype).to(wide))


def default_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions 0.. over real tokens (left padding shifts them), as transformers computes them."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
