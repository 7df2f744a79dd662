"""What the offline APIs take before any model runs: vLLM's prompt forms, and `LLM`'s keyword arguments
as `EngineArgs`. Shared by the generating `LLM` (`engine/llm.py`) and the pooling one (`engine/pooling.py`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pagedrl.engine.engine_args import EngineArgs

Prompt = str | list[int]
# vLLM's TextPrompt and TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}, and either's
# optional "cache_salt" (its prefix-cache blocks are shared only with prompts of the same salt)
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def as_prompt(prompt: Any, index: int) -> tuple[Prompt, str | None]:
    """A text or token-id prompt from any of vLLM's forms (a dict is a TextPrompt or a TokensPrompt),
    and its cache_salt; a form the engine does not take is a ValueError naming the prompt and the keys
    it knows."""
    if not isinstance(prompt, Mapping):
        return prompt, None  # a str or ids: checked by the engine, naming what is wrong
    unknown = sorted(set(prompt) - {*PROMPT_KEYS, "cache_salt"})
    if unknown or len(set(prompt) & set(PROMPT_KEYS)) != 1:
        raise ValueError(f"prompts[{index}]: a prompt dict holds exactly one of {', '.join(PROMPT_KEYS)} "
                         f"(vLLM's TextPrompt or TokensPrompt) and may hold cache_salt, got keys {sorted(prompt)}")
    text_or_ids = list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else prompt["prompt"]
    return text_or_ids, prompt.get("cache_salt")


def engine_args_from(model: str | None, engine_args: dict[str, Any]) -> EngineArgs:
    """`LLM`'s keyword arguments as `EngineArgs`; a name that is not a field is a TypeError that says
    which field was probably meant."""
    names = [f.name for f in fields(EngineArgs)]
    for name in engine_args:
        if name not in names:
            guess = difflib.get_close_matches(name, names, n=1)
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {guess[0]!r}?" if guess else "; see EngineArgs for the fields"))
    return EngineArgs(model=model, **engine_args)
