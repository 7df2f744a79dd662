"""Which of a Qwen2/Qwen3 model's layers slide, read as transformers reads it.

transformers applies Qwen's `sliding_window` only with `use_sliding_window`, and then only in the
layers `layer_types` names `sliding_attention`; without `layer_types`, layer i slides when
i >= `max_window_layers` (28 by default, so a model of 28 layers or fewer slides nowhere). The engine
keeps two cases exact: every layer slides (a uniform window, `max_window_layers` 0), or the first
layers are full and the rest slide (the context is then capped at the window, where sliding and full
attention agree). A config saying otherwise is turned into the one of these it means, or refused.
"""

from __future__ import annotations

from typing import Any

from pagedrl.model.config_error import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
QWEN_LAYER_KINDS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # (Qwen3-MoE's window, when on, is every layer's)


def qwen_window_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The config fields that say the same as `raw`'s `layer_types` / `max_window_layers` in the
    engine's terms: `use_sliding_window` False where no layer slides, else `max_window_layers` the
    index of the first sliding layer."""
    if not raw.get("use_sliding_window", False) or not raw.get("sliding_window"):
        return {}
    layers = int(raw.get("num_hidden_layers") or 0)
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must list {layers} entries of {SLIDING!r} or {FULL!r}, "
                          f"got {types!r}")
    if SLIDING not in types:
        return {"use_sliding_window": False}
    first = types.index(SLIDING)
    if FULL in types[first:]:
        raise ConfigError(f"{source}: field 'layer_types' has full layers after sliding ones ({types}); pagedrl "
                          "builds Qwen models whose sliding layers come last (transformers' max_window_layers rule)")
    return {"max_window_layers": first}
