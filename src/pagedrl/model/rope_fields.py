"""The rope fields of a config.json that need more than a type name: Phi-3's LongRoPE (and its older
spellings), YaRN's stretch, each checked as transformers reads it, with errors that name the field."""

from __future__ import annotations

from typing import Any

from pagedrl.model.config_error import ConfigError


def phi3_fields(raw: dict[str, Any], rope: dict[str, Any], scaling: dict[str, Any] | None,
                source: str) -> dict[str, Any]:
    """Phi-3's rope fields as transformers' Phi3Config reads them (`scaling` completed in place):
    `partial_rotary_factor` from the rope parameters or the top level; rope types "su" and "yarn"
    (older Phi-3 configs) meaning "longrope"; LongRoPE's `original_max_position_embeddings` always the
    top-level field (default 4096), which transformers puts over the rope parameters' own. Dropouts (`resid_pdrop`, `embd_pdrop`,
    `attention_dropout`) stay as extras: pagedrl computes without dropout, as the published configs
    set them (0), and writes them back."""
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be a number, got {partial!r}")
    fields: dict[str, Any] = dict(partial_rotary_factor=float(partial))
    if scaling is not None:
        if scaling["rope_type"] in ("su", "yarn"):
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "longrope":
            scaling["original_max_position_embeddings"] = raw.get("original_max_position_embeddings", 4096)
            scaling.pop("partial_rotary_factor", None)  # the field's
    return fields


def validate_yarn(scaling: dict[str, Any], source: str) -> None:
    """YaRN's parameters: the stretch and the original context length it is measured from."""
    for name in ("factor", "original_max_position_embeddings"):
        value = scaling.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{source}: rope field {name!r} must be a positive number for rope type 'yarn', "
                              f"got {value!r}")


def validate_longrope(scaling: dict[str, Any], rotary_dim: int, source: str) -> None:
    """LongRoPE's parameters: a factor per rotary pair in each set, and the original context length."""
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{source}: field 'original_max_position_embeddings' must be a positive integer "
                          f"for rope type 'longrope', got {original!r}")
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if (not isinstance(factors, list) or len(factors) != rotary_dim // 2
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
            raise ConfigError(f"{source}: rope field {name!r} must be a list of {rotary_dim // 2} positive numbers "
                              f"(one per rotary pair), got {factors!r}")
