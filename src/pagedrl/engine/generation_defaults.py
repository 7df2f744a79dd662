"""The sampling defaults a model's generation config recommends, chosen as vLLM chooses them
(`ModelConfig.get_diff_sampling_param` and its servers' `override_max_tokens`).

`generation_config` is `auto` (the model's own generation_config.json), `vllm` (none: SamplingParams'
own defaults) or a folder holding a generation_config.json; `override_generation_config` then changes or
adds keys of it. Of those keys, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
`max_new_tokens` (as `max_tokens`) become the defaults of the requests that leave them unset. A
`max_new_tokens` from a folder, or from the override, also caps every request's `max_tokens` on the server:
the operator chose it, whereas the model's own is only a recommendation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedrl.engine.sampling_params import SamplingParams

# generation_config.json's settings that vLLM takes as defaults, by SamplingParams' names
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_CHOICES = ("auto", "vllm")


def sampling_defaults(generation_config: dict[str, Any], source: str = "generation_config.json") -> dict[str, Any]:
    """The sampling defaults a generation config recommends, by SamplingParams' names; a value
    SamplingParams refuses is a ValueError naming `source` and the field."""
    defaults = {ours: generation_config[theirs] for theirs, ours in GENERATION_DEFAULTS.items()
                if generation_config.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return defaults


@dataclass(frozen=True)
class GenerationDefaults:
    """What unset sampling settings become (`params`, by SamplingParams' names) and the most tokens a
    served request may ask for (`max_tokens_cap`; None: the context's)."""

    params: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    source: str = ""

    def describe(self) -> str:
        cap = f"; every request's max_tokens at most {self.max_tokens_cap}" if self.max_tokens_cap else ""
        return f"{self.params} from {self.source}{cap}"


def read_folder_config(folder: str) -> dict[str, Any]:
    """A `generation_config` folder's generation_config.json; a missing or unreadable one is named,
    rather than served as no defaults at all."""
    path = Path(folder).expanduser() / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"generation_config: {path} does not exist (give auto, vllm or a folder holding a "
                         "generation_config.json)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return config


def generation_defaults(setting: str, model_config: dict[str, Any], model_source: str,
                        override: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults for `generation_config=setting` over the model's own generation config
    (`model_config`, read from `model_source`) and `override_generation_config`."""
    if setting == "vllm":
        config, source = {}, "SamplingParams' defaults"
    elif setting == "auto":
        config, source = dict(model_config), model_source
    else:
        config, source = read_folder_config(setting), str(Path(setting) / "generation_config.json")
    if override:
        config.update(override)
        source += " with override_generation_config"
    params = sampling_defaults(config, source)
    cap = params.get("max_tokens") if setting not in GENERATION_CONFIG_CHOICES \
        else (override or {}).get("max_new_tokens")
    return GenerationDefaults(params, cap, source)


def capped(max_tokens: int | None, cap: int | None) -> int | None:
    """A request's max_tokens under the operator's cap (None: up to the context)."""
    if cap is None:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)
