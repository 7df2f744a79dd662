"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), in transformers' order of operations.

Queries: `q_proj`, or with `q_lora_rank` a low-rank pair `q_b_proj(q_a_layernorm(q_a_proj(x)))`; each
head's query is a part without position (`qk_nope_head_dim`) and a rotated part (`qk_rope_head_dim`).
Keys and values come from one latent per token: `kv_a_proj_with_mqa(x)` gives `kv_lora_rank`
features, normed by `kv_a_layernorm`, and `qk_rope_head_dim` features of a key part shared by every
head, rotated. `kv_b_proj` up-projects the normed latent into each head's unrotated key part and its
value; the key is [that part, the shared rotated part]. Scores are scaled by `softmax_scale`
(qk_head_dim^-1/2, yarn's mscale² under a yarn rope).

What a cache needs per token and layer is therefore the latent alone, kv_lora_rank + qk_rope_head_dim
numbers (576 for DeepSeek-V3, against 2 × 128 heads × 192 = 49,152 for its keys and values in full):
a paged cache whose metadata has `attend_latent` (`engine/attention.py`) is handed the latent, the
up-projection and its weight cut per head (`absorbed`), and stores the former; any other metadata (a
training batch) gets the expanded keys and values through `attend`, as every other family's layer
hands them over.

The rotation: with `rope_interleave` (the family's default) each rotary pair is two adjacent features
(x0, x1), (x2, x3), …, and the output is laid out as transformers lays it out, the pairs' first
members then their second ones; queries and keys alike, so their products are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedrl.model.attention import AttentionMetadata
from pagedrl.model.config import ModelConfig
from pagedrl.model.rope import rotate
from pagedrl.model.routed import Linear

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm: Callable[[int, float], nn.Module]) -> None:
        super().__init__()
        rules = cfg.deepseek
        assert rules is not None
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = rules.qk_nope_head_dim, rules.qk_rope_head_dim, rules.v_head_dim
        self.rank, self.interleave = rules.kv_lora_rank, rules.rope_interleave
        qk = self.nope + self.rope
        bias = cfg.attention_bias
        if rules.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, rules.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(rules.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(rules.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.low_rank_queries = rules.q_lora_rank is not None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_queries else self.q_proj(x)
        q_pass, q_rot = q.view(B, T, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        rotation = rotate_interleaved if self.interleave else rotate
        q_rot, k_rot = rotation(q_rot, k_rot[:, :, None], cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        latent = torch.cat((kv_nope, k_rot[:, :, 0]), dim=-1)  # [B, T, kv_lora_rank + qk_rope_head_dim]
        attend_latent = getattr(meta, "attend_latent", None)
        if attend_latent is not None:
            out = attend_latent(self.layer, q, latent, self.expand, self.absorbed())
        else:
            k, v = self.expand(latent)
            out = meta.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim))

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`kv_b_proj`'s weight cut per head into its key rows [heads, qk_nope_head_dim, kv_lora_rank] and
        value rows [heads, v_head_dim, kv_lora_rank] (views), for a cache that attends over latents
        without expanding them; None where kv_b_proj is not a plain float projection (an adapter,
        quantized weights): there the cached latents are expanded through the module."""
        if type(self.kv_b_proj) is not Linear:
            return None
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return weight[:, :self.nope], weight[:, self.nope:]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [..., kv_lora_rank + qk_rope_head_dim] → keys [..., heads, qk_head_dim] and values
        [..., heads, v_head_dim], through `kv_b_proj` (an adapter on it included)."""
        kv = self.kv_b_proj(latent[..., :self.rank]).view(*latent.shape[:-1], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = latent[..., None, self.rank:].expand(*k_nope.shape[:-1], self.rope)
        return torch.cat((k_nope, k_rot), dim=-1), v


def rotate_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb_interleave`: pair i is features (2i, 2i+1), turned by cos/sin's
    i-th angle; out = [x_even cos - x_odd sin, x_odd cos + x_even sin]. q, k [..., T, heads, D];
    cos, sin [..., T, D] (each angle twice, `rope_cos_sin`'s layout)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)

    def turn(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    return turn(q), turn(k)
