"""What Gemma 2 and Gemma 3 add to the decoder, read from their config.json and applied per layer.

Both families are the same decoder with: RMSNorm scaling by (1 + weight) in float32, embeddings
scaled by sqrt(hidden_size), an attention scale of `query_pre_attn_scalar`^-1/2, four norms per
layer (a norm after attention and after the feed-forward too), a tanh-GELU gated feed-forward, tied
embeddings, and layers of two kinds: `sliding_attention` layers see only the last `sliding_window`
keys, `full_attention` layers all of them. Gemma 3 adds q/k RMSNorm and a rotary base of its own
for the sliding layers (`rope_local_base_freq`); Gemma 2 soft-caps attention scores and the final
logits with tanh.

The per-layer rules reach the attention through the metadata (`with_layer_rules`), so a dense
training batch and the paged engine apply the same windows, scale and soft-capping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedrl.model.config_error import ConfigError

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# config.json fields these families publish that `gemma_fields` reads (not kept as extras).
GEMMA_FIELDS = ("query_pre_attn_scalar", "layer_types", "sliding_window_pattern", "rope_local_base_freq",
                "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation", "rope_scaling",
                "use_bidirectional_attention")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaRules:
    """The per-layer rules of a Gemma 2/3 model, under transformers' field names."""

    query_pre_attn_scalar: int | float  # (kept as given: transformers' config insists on an int)
    sliding_window: int | None
    layer_types: tuple[str, ...]
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rotary base (no scaling)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` may see back (itself included); None: all of them."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5


def gemma_fields(raw: dict[str, Any], base: str, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2/3 config.json (none for another family): the rules, the
    activation, and the global layers' rope. The window goes into the rules, not `sliding_window`,
    which means every layer's window (and caps the context the engine serves)."""
    if base not in GEMMA_ARCHITECTURES:
        return {}
    gemma3 = base == "Gemma3ForCausalLM"
    layers = raw["num_hidden_layers"]
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention' is not supported (only causal attention)")
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern", 6 if gemma3 else 2))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"{source}: field 'layer_types' must list {layers} entries of {SLIDING!r} or {FULL!r}, "
                          f"got {types!r}")
    window = raw.get("sliding_window")
    if SLIDING in types and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer, got {window!r}")
    rope = raw.get("rope_parameters") or {}
    if gemma3:  # {"full_attention": {...}, "sliding_attention": {...}}, or the older flat fields
        full = rope.get(FULL) or {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1e6)}
        local = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 1e4)}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: the sliding layers' rope type {local['rope_type']!r} is not supported "
                              "(only default)")
        local_theta = float(local.get("rope_theta", 1e4))
    else:
        full = rope or {"rope_theta": raw.get("rope_theta", 10000.0)}
        local_theta = None
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind in (None, "default") else {**full, "rope_type": kind}
    if scaling is not None:
        scaling.pop("rope_theta", None)
    rules = GemmaRules(
        query_pre_attn_scalar=_positive(raw, "query_pre_attn_scalar", 256, source),
        sliding_window=window if SLIDING in types else None,
        layer_types=tuple(types),
        local_rope_theta=local_theta,
        # Gemma 3 keeps the field but its attention never applies it (transformers' and the published weights')
        attn_logit_softcapping=None if gemma3 else _cap(raw, "attn_logit_softcapping", 50.0, source),
        final_logit_softcapping=_cap(raw, "final_logit_softcapping", None if gemma3 else 30.0, source),
    )
    return dict(gemma=rules, sliding_window=None, rope_theta=float(full.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")


def _cap(raw: dict[str, Any], name: str, default: float | None, source: str) -> float | None:
    value = raw.get(name, default)
    return None if value is None else float(_positive(raw, name, default, source))


def _positive(raw: dict[str, Any], name: str, default: float | None, source: str) -> int | float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{source}: field {name!r} must be a positive number{' or null' if default is None else ''}, "
                          f"got {value!r}")
    return value


def gemma_dict(cfg: Any) -> dict[str, Any]:
    """The family's own config.json fields, as transformers writes them (for `ModelConfig.to_dict`)."""
    rules: GemmaRules = cfg.gemma
    full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = dict(
        query_pre_attn_scalar=rules.query_pre_attn_scalar, sliding_window=rules.sliding_window,
        layer_types=list(rules.layer_types), attn_logit_softcapping=rules.attn_logit_softcapping,
        final_logit_softcapping=rules.final_logit_softcapping, hidden_activation=cfg.hidden_act,
        rope_parameters=full,
    )
    if rules.local_rope_theta is not None:
        out["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": rules.local_rope_theta}}
    return out


class GemmaRMSNorm(nn.Module):
    """RMSNorm times (1 + weight), all in float32, rounded once: transformers' order for Gemma (the
    weights are stored as offsets from 1, so the usual `weight * x` would be off by x)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(x / cap): scores or logits squashed into (-cap, cap), as Gemma 2 trains them."""
    return x if cap is None else torch.tanh(x / cap) * cap


def embed_scale(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Embeddings times sqrt(hidden_size), the factor rounded to their dtype first as transformers does."""
    return x * torch.tensor(hidden_size**0.5, dtype=torch.float32).to(x.dtype)


def with_layer_rules(meta: Any, rules: GemmaRules, positions: torch.Tensor) -> Any:
    """The attention metadata with the rules attached: each layer's window, the scale, the score cap.
    Metadata that cannot apply them is refused by name rather than attending over the wrong keys."""
    if not hasattr(meta, "windows"):
        raise TypeError(f"{type(meta).__name__} does not implement per-layer sliding windows (Gemma)")
    windows = tuple(rules.window(i) for i in range(len(rules.layer_types)))
    extra = {"key_positions": positions} if hasattr(meta, "key_positions") else {}
    return dataclasses.replace(meta, windows=windows, scale=rules.scale, softcap=rules.attn_logit_softcapping,
                               **extra)
