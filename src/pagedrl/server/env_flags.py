"""Switches a server reads from its environment, as vLLM reads its own (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`,
`VLLM_ENABLE_RESPONSES_API_STORE`): one reading, so every such switch takes the same spellings."""

from __future__ import annotations

import os

TRUE_SPELLINGS = {"1", "true", "yes", "on"}


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` is set to a true spelling (any case, spaces ignored)."""
    return os.environ.get(name, "").strip().lower() in TRUE_SPELLINGS
