"""gpt-oss GGUF files (llama.cpp's `gpt-oss`) as the Hugging Face config and tensors `model/gpt_oss.py` runs.

llama.cpp's converter splits each layer's interleaved `gate_up_proj` [E, H, 2I] into `ffn_gate_exps` and
`ffn_up_exps` ([E, I, H] each, one row an output, as every GGUF projection), transposes `down_proj` into
`ffn_down_exps` [E, H, I], splits the interleaved bias the same way, writes the sinks as `attn_sinks`, the
router as `ffn_gate_inp` and the norm before the experts as `post_attention_norm`; the experts are
usually MXFP4, dequantized here. What the file leaves out is llama.cpp's runtime rule, taken here the
same way: layers alternate sliding and full from the first, the SwiGLU clamp is 7 and its alpha 1.702,
and YaRN's betas are 32 and 1 unless the file names them, on the whole ramp (transformers'
`truncate: false`, gpt-oss's own setting).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pagedrl.model.config import ModelConfig
from pagedrl.model.gguf_metadata import GGUFError, Metadata, published_float

GPT_OSS = {"gpt-oss": "GptOssForCausalLM"}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def gpt_oss_config(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    """The model's config.json from the file's metadata and llama.cpp's rules for what it leaves out."""
    p = "gpt-oss."
    layers = int(meta.need(p + "block_count"))
    hidden, heads = int(meta.need(p + "embedding_length")), int(meta.need(p + "attention.head_count"))
    window = int(meta.need(p + "attention.sliding_window"))
    scaling_type = meta.get(p + "rope.scaling.type", "none")
    if scaling_type not in ("none", "yarn"):
        raise GGUFError(f"{meta.source}: {p}rope.scaling.type {scaling_type!r} is not supported (yarn, none)")
    theta = published_float(meta.get(p + "rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": published_float(meta.need(p + "rope.scaling.factor")),
                "beta_fast": published_float(meta.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": published_float(meta.get(p + "rope.scaling.yarn_beta_slow", 1.0)), "truncate": False,
                "original_max_position_embeddings": int(meta.need(p + "rope.scaling.original_context_length"))}
    experts = int(meta.need(p + "expert_count"))
    raw = dict(
        **meta.common_fields(p, tensors, eps=1e-5, context=131072),
        architectures=[GPT_OSS["gpt-oss"]],
        hidden_size=hidden,
        intermediate_size=int(meta.get(p + "expert_feed_forward_length") or meta.need(p + "feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        head_dim=int(meta.get(p + "attention.key_length", hidden // heads)),
        sliding_window=window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        num_local_experts=experts,
        num_experts_per_tok=int(meta.need(p + "expert_used_count")),
        rope_parameters=rope,
    )
    return ModelConfig.from_dict(raw, meta.source)


def gpt_oss_state(arrays: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """The file's tensors (float32, in transformers' dims order) under transformers' names and layout:
    gate and up interleaved again into `gate_up_proj` [E, H, 2I] and its bias, `down_proj` [E, I, H]."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[str, np.ndarray]] = {}
    for name, w in arrays.items():
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        m = _NAME.fullmatch(name)
        if m is None:
            raise GGUFError(f"{source}: tensor {name!r} has no Hugging Face counterpart in a gpt-oss model")
        layer, kind, suffix = m.groups()
        prefix = f"model.layers.{layer}."
        if kind == "attn_sinks":
            out[prefix + "self_attn.sinks"] = w
        elif kind in _LAYER:
            out[f"{prefix}{_LAYER[kind]}.{suffix}"] = w
        elif kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            experts.setdefault(layer, {})[f"{kind.split('_')[1]}.{suffix}"] = w
        else:
            raise GGUFError(f"{source}: tensor {name!r} has no Hugging Face counterpart in a gpt-oss model")
    for layer, parts in experts.items():
        need = {f"{p}.{s}" for p in ("gate", "up", "down") for s in ("weight", "bias")}
        if set(parts) != need:
            raise GGUFError(f"{source}: layer {layer}'s experts have {sorted(parts)}; gpt-oss needs {sorted(need)}")
        base = f"model.layers.{layer}.mlp.experts."
        gate, up = parts["gate.weight"], parts["up.weight"]  # [E, I, H]
        gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), dtype=np.float32)
        gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        bias = np.empty((gate.shape[0], 2 * gate.shape[1]), dtype=np.float32)
        bias[:, 0::2], bias[:, 1::2] = parts["gate.bias"], parts["up.bias"]
        out[base + "gate_up_proj"], out[base + "gate_up_proj_bias"] = gate_up, bias
        out[base + "down_proj"] = np.ascontiguousarray(parts["down.weight"].transpose(0, 2, 1))
        out[base + "down_proj_bias"] = parts["down.bias"]
    return out
