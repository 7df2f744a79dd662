"""Gemma 2 and Gemma 3 (text) GGUF files (llama.cpp's `gemma2`, `gemma3`) as the Hugging Face config and
tensors `model/gemma.py` runs.

What a Gemma file leaves out, llama.cpp's runtime decides, and so does this reader, rule for rule (its
`llama-model.cpp`): the layer kinds (Gemma 2: every other layer sliding, from the first; Gemma 3: five
sliding then one global), the sliding layers' rotary base of Gemma 3 (10000 unless the file says
`rope.freq_base_swa`, never scaled), the attention scale (1/sqrt(head_dim), except in the 27B models,
told apart by their layer count, which scale by 1/sqrt(hidden / heads) as Google's code does), and Gemma
2's soft-capping of 50 and 30 when the file names none. The embeddings' sqrt(hidden) scale is the
model's, not stored. llama.cpp's converter stores each RMSNorm weight as 1 + w (its runtime multiplies
by the weight alone); `norm_offset` takes the 1 back off, as transformers' GGUF reader does: for a
weight w in [-0.5, 1], 1 + ((1 + w) - 1) is exactly the rounded 1 + w the original model multiplies by.
"""

from __future__ import annotations

from typing import Any

from pagedrl.model.config import ModelConfig
from pagedrl.model.gemma import FULL, SLIDING
from pagedrl.model.gguf_metadata import GGUFError, Metadata, published_float

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's names for the sandwich norms (`ffn_norm` is the norm before the feed-forward here, where
# Llama's is the one after attention).
GEMMA_LAYER_TENSORS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# (architecture, layer count) of the 27B models, whose attention scale llama.cpp takes from hidden / heads.
_SCALED_BY_WIDTH = {("gemma2", 46), ("gemma3", 62)}
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's `set_swa_pattern`


def norm_offset(name: str, architecture: str) -> float:
    """What llama.cpp's converter added to GGUF tensor `name` (1 to a Gemma norm weight, else 0)."""
    return 1.0 if architecture in GEMMA_ARCHITECTURES.values() and name.endswith("norm.weight") else 0.0


def gemma_config(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    """The model's config.json, as transformers writes it for this Gemma, from the file's metadata and
    llama.cpp's rules for what the metadata leaves out."""
    arch = meta.need("general.architecture")
    p = f"{arch}."
    hidden, heads = int(meta.need(p + "embedding_length")), int(meta.need(p + "attention.head_count"))
    layers = int(meta.need(p + "block_count"))
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    kv_heads = meta.get(p + "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise GGUFError(f"{meta.source}: per-layer {p}attention.head_count_kv {kv_heads} is not supported")
    window = meta.get(p + "attention.sliding_window") if arch == "gemma3" else meta.need(p + "attention.sliding_window")
    pattern = _SLIDING_PATTERN[arch]
    # (a Gemma 3 file without a window has global layers only: its converter writes none then)
    types = [SLIDING if window and i % pattern < pattern - 1 else FULL for i in range(layers)]
    theta = published_float(meta.get(p + "rope.freq_base", 10000.0))
    scaling_type = meta.get(p + "rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise GGUFError(f"{meta.source}: {p}rope.scaling.type {scaling_type!r} is not supported (linear, none)")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling_type == "linear":
        full = {"rope_type": "linear", "factor": published_float(meta.need(p + "rope.scaling.factor")), "rope_theta": theta}
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{meta.source}: partial rotary embeddings ({p}rope.dimension_count={rot}, "
                        f"head_dim={head_dim}) are not supported in {arch!r} files")
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": published_float(meta.get(p + "rope.freq_base_swa", 10000.0))}
        rope: dict[str, Any] = {FULL: full, SLIDING: local}
        caps = {"attn_logit_softcapping": None, "final_logit_softcapping": meta.get(p + "final_logit_softcapping")}
    else:
        rope = full
        caps = {"attn_logit_softcapping": meta.get(p + "attn_logit_softcapping", 50.0),
                "final_logit_softcapping": meta.get(p + "final_logit_softcapping", 30.0)}
    raw = dict(
        **meta.common_fields(p, tensors, eps=1e-6, context=8192),
        architectures=[GEMMA_ARCHITECTURES[arch]],
        hidden_size=hidden,
        intermediate_size=int(meta.need(p + "feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        sliding_window=int(window) if window else None,
        layer_types=types,
        query_pre_attn_scalar=hidden // heads if (arch, layers) in _SCALED_BY_WIDTH else head_dim,
        **{k: None if v is None else published_float(v) for k, v in caps.items()},
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters=rope,
    )
    return ModelConfig.from_dict(raw, meta.source)
