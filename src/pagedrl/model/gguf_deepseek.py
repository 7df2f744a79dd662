"""DeepSeek-V3 and Kimi K2 GGUF files (llama.cpp's `deepseek2`) as the Hugging Face config and tensors
`model/deepseek.py` runs.

llama.cpp's converter writes the latent attention's sizes as its own fields (`attention.q_lora_rank`,
`attention.kv_lora_rank`, `attention.key_length_mla` = nope + rope, `attention.value_length_mla`,
`rope.dimension_count` = the rotary part), the routing rule as `expert_gating_func` (sigmoid for
DeepSeek-V3), `expert_weights_norm`, `expert_weights_scale` (the routed scaling factor) and the expert
groups, the dense first layers as `leading_dense_block_count`, the correction bias as `exp_probs_b.bias`
and the shared experts as `ffn_*_shexp`. It splits each layer's `kv_b_proj` into `attn_k_b` (the key
half, per head transposed: [heads, kv_lora_rank, nope]) and `attn_v_b` ([heads, v_head_dim,
kv_lora_rank]) for llama.cpp's absorbed attention; files from before that split hold `attn_kv_b` whole.
`kv_b_proj` is put back together here. What the file leaves out is llama.cpp's runtime rule, read the same
way: no `expert_weights_scale` means a scale of 1, no `expert_weights_norm` means no renormalisation, no
expert groups means one group; YaRN's `mscale` equals its `mscale_all_dim` (the converter stores the
latter only, as 0.1 x `rope.scaling.yarn_log_multiplier`), and the rotary pairs are adjacent (transformers'
`rope_interleave`). DeepSeek-V2's softmax routing is refused: that is another transformers class.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pagedrl.model.config import ModelConfig
from pagedrl.model.gguf_metadata import GGUFError, Metadata, published_float

DEEPSEEK2 = {"deepseek2": "DeepseekV3ForCausalLM"}
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, DeepSeek-V2's)
DEEPSEEK_LAYER_TENSORS = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # (files from before the k_b / v_b split)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_HALVES = re.compile(r"blk\.(?P<layer>\d+)\.attn_(?P<half>k|v)_b\.weight")
CORRECTION_BIAS = re.compile(r"blk\.(\d+)\.exp_probs_b\.bias")


def deepseek_config(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    """The model's config.json, as transformers writes it for a DeepSeek-V3, from the file's metadata and
    llama.cpp's rules for what the metadata leaves out."""
    p, source = "deepseek2.", meta.source
    gating = meta.get(p + "expert_gating_func")
    if gating != _SIGMOID:
        raise GGUFError(f"{source}: {p}expert_gating_func is {gating!r}: only DeepSeek-V3's sigmoid routing (2) is "
                        "supported; DeepSeek-V2 / V2.5 files (softmax, 1 or absent) are not")
    rope_dim = int(meta.need(p + "rope.dimension_count"))
    qk_head_dim = meta.get(p + "attention.key_length_mla")
    if qk_head_dim is None:  # (before the split the key length was the whole head's)
        qk_head_dim, v_head_dim = int(meta.need(p + "attention.key_length")), int(meta.need(p + "attention.value_length"))
    else:
        qk_head_dim, v_head_dim = int(qk_head_dim), int(meta.need(p + "attention.value_length_mla"))
    if qk_head_dim <= rope_dim:
        raise GGUFError(f"{source}: {p}attention.key_length_mla ({qk_head_dim}) must exceed {p}rope.dimension_count "
                        f"({rope_dim}): each head's key is a part without rotary embeddings and a rotary part")
    layers, experts = int(meta.need(p + "block_count")), int(meta.need(p + "expert_count"))
    q_lora = meta.get(p + "attention.q_lora_rank")
    groups = int(meta.get(p + "expert_group_count") or 1)
    raw = dict(
        **meta.common_fields(p, tensors, eps=1e-6, context=163840),
        architectures=[DEEPSEEK2["deepseek2"]],
        hidden_size=int(meta.need(p + "embedding_length")),
        intermediate_size=int(meta.need(p + "feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(meta.need(p + "attention.head_count")),
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(meta.need(p + "attention.kv_lora_rank")),
        qk_nope_head_dim=qk_head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_head_dim,
        rope_interleave=True,
        n_routed_experts=experts,
        num_experts_per_tok=int(meta.need(p + "expert_used_count")),
        moe_intermediate_size=int(meta.need(p + "expert_feed_forward_length")),
        n_shared_experts=int(meta.get(p + "expert_shared_count", 0)),
        n_group=groups,
        topk_group=int(meta.get(p + "expert_group_used_count") or groups),
        routed_scaling_factor=published_float(meta.get(p + "expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta.get(p + "expert_weights_norm", False)),
        first_k_dense_replace=int(meta.get(p + "leading_dense_block_count", 0)),
        rope_parameters=_rope(meta, p),
    )
    return ModelConfig.from_dict(raw, source)


def _rope(meta: Metadata, p: str) -> dict[str, Any]:
    theta = published_float(meta.get(p + "rope.freq_base", 10000.0))
    scaling_type = meta.get(p + "rope.scaling.type", "none")
    if scaling_type == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling_type != "yarn":
        raise GGUFError(f"{meta.source}: {p}rope.scaling.type {scaling_type!r} is not supported (yarn, none)")
    log_multiplier = meta.get(p + "rope.scaling.yarn_log_multiplier")
    if log_multiplier is None:
        raise GGUFError(f"{meta.source}: a YaRN file without {p}rope.scaling.yarn_log_multiplier is not supported "
                        "(llama.cpp then scales attention in a way no transformers config states)")
    mscale = published_float(log_multiplier / 0.1)  # (the converter wrote 0.1 x mscale_all_dim)
    return {"rope_type": "yarn", "rope_theta": theta, "factor": published_float(meta.need(p + "rope.scaling.factor")),
            "original_max_position_embeddings": int(meta.need(p + "rope.scaling.original_context_length")),
            "beta_fast": published_float(meta.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": published_float(meta.get(p + "rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}


def kv_b_halves(name: str) -> tuple[int, str] | None:
    """(layer, "k" or "v") when `name` is one half of a layer's split `kv_b_proj`."""
    m = _HALVES.fullmatch(name)
    return None if m is None else (int(m["layer"]), m["half"])


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`kv_b_proj` [heads x (nope + v), kv_lora_rank] from the converter's halves: `attn_k_b` [heads,
    kv_lora_rank, nope] (each head's key rows transposed) and `attn_v_b` [heads, v, kv_lora_rank]."""
    rules = cfg.deepseek
    heads, rank = cfg.num_attention_heads, rules.kv_lora_rank
    k_b = k_b.reshape(heads, rank, rules.qk_nope_head_dim).transpose(0, 2, 1)
    v_b = v_b.reshape(heads, rules.v_head_dim, rank)
    return np.ascontiguousarray(np.concatenate([k_b, v_b], axis=1).reshape(-1, rank))


def join_kv_b_state(state: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict[str, np.ndarray]:
    """`state` with each layer's `attn_k_b` / `attn_v_b` pair (still under the file's names) replaced by
    its `kv_b_proj`."""
    halves: dict[int, dict[str, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if (found := kv_b_halves(name)) is None:
            out[name] = w
        else:
            halves.setdefault(found[0], {})[found[1]] = w
    for layer, pair in sorted(halves.items()):
        if sorted(pair) != ["k", "v"]:
            raise GGUFError(f"{source}: layer {layer} has attn_{''.join(pair)}_b without its other half "
                            "(kv_b_proj needs attn_k_b and attn_v_b)")
        out[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = join_kv_b(pair["k"], pair["v"], cfg)
    return out
