"""What gpt-oss (`GptOssForCausalLM`) adds to the decoder, read from its config.json.

gpt-oss is the Llama-family decoder with a mixture of experts in every layer and four rules of its
own, each computed in transformers' order (`transformers/models/gpt_oss/modeling_gpt_oss.py`):

- attention sinks: each head has a learned logit that joins every query's softmax as one more
  column and is then dropped, so a head may put part of its weight on no key at all;
- layers of two kinds (`layer_types`): `sliding_attention` layers see the last `sliding_window` keys,
  `full_attention` layers all of them; q/k/v/o carry biases;
- the router is a projection with a bias; a token takes the top k of its logits, weighted by the
  softmax over those k alone (`model/moe.py`);
- the experts' clamped SwiGLU (`clamped_swiglu`), their weights stacked as transformers holds them
  (`gate_up_proj` [E, H, 2I] with gate and up columns interleaved, `down_proj` [E, I, H], a bias each).

Its rotary embedding is YaRN (`model/rope.py`). Published checkpoints hold the experts' weights as
MXFP4 blocks, dequantized at load (`model/mxfp4.py`) or kept so with `quantization="mxfp4"`
(`model/mxfp4_experts.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedrl.model.config_error import ConfigError

GPT_OSS_ARCHITECTURE = "GptOssForCausalLM"
# config.json fields this family publishes that `gpt_oss_fields` reads (not kept as extras).
GPT_OSS_FIELDS = ("layer_types", "swiglu_limit", "swiglu_alpha", "quantization_config", "rope_scaling")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssRules:
    """The per-layer windows and the experts' activation of a gpt-oss model, under transformers' names."""

    layer_types: tuple[str, ...]
    sliding_window: int | None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` may see back (itself included); None: all of them."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def gpt_oss_fields(raw: dict[str, Any], base: str, source: str) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss config.json (none for another family): the rules, the mixture of
    experts' fields and the rope (YaRN unless the config names another). The window goes into the
    rules, not `sliding_window`, which means every layer's window (and caps the context the engine serves)."""
    if base != GPT_OSS_ARCHITECTURE:
        return {}
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:  # transformers' default: sliding, full, sliding, ...
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"{source}: field 'layer_types' must list {layers} entries of {SLIDING!r} or {FULL!r}, "
                          f"got {types!r}")
    window = raw.get("sliding_window", 128)
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer, got {window!r}")
    quant = raw.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        raise ConfigError(f"{source}: field 'quantization_config' names {quant!r}; only quant_method 'mxfp4' "
                          "(the published experts' format) is supported")

    def number(name: str, default: float) -> float:
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{source}: field {name!r} must be a positive number, got {value!r}")
        return float(value)

    def count(name: str, default: int) -> int:
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
        return value

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind in (None, "default") else {**rope, "rope_type": kind}
    if scaling is not None:
        scaling.pop("rope_theta", None)
        scaling.pop("type", None)
    rules = GptOssRules(layer_types=tuple(types), sliding_window=window if SLIDING in types else None,
                        swiglu_limit=number("swiglu_limit", 7.0), swiglu_alpha=number("swiglu_alpha", 1.702))
    return dict(gpt_oss=rules, sliding_window=None, rope_scaling=scaling,
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 150000.0))),
                num_experts=count("num_local_experts", 128), num_experts_per_tok=count("num_experts_per_tok", 4),
                router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(raw.get("output_router_logits", False)))


def gpt_oss_dict(cfg: Any) -> dict[str, Any]:
    """The family's own config.json fields, as transformers writes them (for `ModelConfig.to_dict`)."""
    rules: GptOssRules = cfg.gpt_oss
    return dict(layer_types=list(rules.layer_types), sliding_window=rules.sliding_window,
                swiglu_limit=rules.swiglu_limit, swiglu_alpha=rules.swiglu_alpha)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on interleaved gate/up columns: the gate clamped above at `limit`, up
    to ±`limit`, then (up + 1) · gate · sigmoid(alpha · gate), in that order and in gate_up's dtype."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the float32 normalised input, rounded once: transformers keeps
    gpt-oss's norms in float32 (`_keep_in_fp32_modules`), so in bf16 its norm rounds once where the
    Llama family's rounds the normalised input to bf16 before the product. Same in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def with_layer_windows(meta: Any, rules: GptOssRules, positions: torch.Tensor) -> Any:
    """The attention metadata with each layer's window attached (the sinks come with each layer's call).
    Metadata that cannot apply windows is refused by name rather than attending over the wrong keys."""
    if not hasattr(meta, "windows"):
        raise TypeError(f"{type(meta).__name__} does not implement per-layer sliding windows (gpt-oss)")
    windows = tuple(rules.window(i) for i in range(len(rules.layer_types)))
    extra = {"key_positions": positions} if hasattr(meta, "key_positions") else {}
    return dataclasses.replace(meta, windows=windows, **extra)
