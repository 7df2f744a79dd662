"""The names a server answers to: its base model and, with `--enable-lora`, each LoRA adapter.

A request's `model` field picks what runs: the base's name (or none) the base model, an adapter's
name that adapter (vLLM's convention). Adapters come from `--lora-modules` at start-up and, where
runtime updating is allowed, from `/v1/load_lora_adapter` while serving; each gets an id of its own,
never reused, so an adapter loaded again under the same name never meets the old one's KV blocks or
slot. Unloading only stops new requests from naming it: the ones running finish with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedrl.engine.lora_request import LoRARequest
from pagedrl.server.env_flags import env_flag
from pagedrl.server.errors import ApiError

# vLLM's switch for the load/unload endpoints: they read any folder the server can, so they are off
# unless asked for (also `--allow-runtime-lora-updating`).
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


# An adapter's name is what requests send as `model`, what /v1/models lists and what the metrics'
# `running_lora_adapters` label joins with commas: a Hub-style id fits (`org/sql-lora`, `v1.2`), but no
# spaces, commas, quotes or control characters, nothing `name=path` would split, and no unbounded length.
MAX_ADAPTER_NAME_CHARS = 256
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._:/@+-]*$"
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)


def check_adapter_name(name: str) -> None:
    """Refuse (ValueError) a name that breaks the rule above, saying which part of it does."""
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS:
        raise ValueError(f"a LoRA adapter name has 1 to {MAX_ADAPTER_NAME_CHARS} characters; got {len(name)}")
    if not _ADAPTER_NAME.match(name):
        raise ValueError(f"LoRA adapter name {name[:60]!r}: a letter, digit or _ first, then only those and "
                         ". : / @ + - (no spaces, commas or quotes)")


def runtime_updating_from_env() -> bool:
    return env_flag(RUNTIME_UPDATING_ENV)


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules: {text!r} needs string fields \"name\" and \"path\"")
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: {text!r} has unknown field(s) {sorted(unknown)}")
        module = LoRAModule(raw["name"], raw["path"], raw.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: {text!r} is not name=path (nor a JSON object)")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules: {text!r} needs both a name and a path")
    try:
        check_adapter_name(module.name)
    except ValueError as e:
        raise ValueError(f"--lora-modules: {e}") from None
    return module


class ServedModels:
    """The base's names (vLLM's `--served-model-name a b`: the first is the one metrics and /v1/models
    lead with, any of them picks the base) and the adapters by name; `read` checks an adapter (reads it
    from disk)."""

    def __init__(self, base_name: str | Sequence[str], read: Callable[[LoRARequest], object] | None = None) -> None:
        self.base_names = [base_name] if isinstance(base_name, str) else list(dict.fromkeys(base_name))
        if not self.base_names:
            raise ValueError("the base model needs a served name")
        self.base_name = self.base_names[0]
        self.read = read  # reads and checks an adapter; raises ValueError naming what does not fit. None: no LoRA
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    @property
    def lora_enabled(self) -> bool:
        return self.read is not None

    def resolve(self, model: str | None, disclose: bool = True) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base); 404 for a name not served, which
        lists the served names only if `disclose` (a client that could read /v1/models anyway)."""
        if model is None or model in self.base_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            served = ", ".join(repr(n) for n in [*self.base_names, *self.adapters])
            listing = f"; this server serves {served}" if disclose else ""
            raise ApiError(404, f"the model '{model}' does not exist{listing}",
                           "not_found_error", param="model", code="model_not_found")
        return lora

    def new_request(self, module: LoRAModule) -> LoRARequest:
        """A LoRARequest for `module` under a fresh id, not yet checked nor served."""
        if not self.lora_enabled:
            raise ValueError("LoRA adapters need --enable-lora")
        check_adapter_name(module.name)
        if module.name in self.base_names:
            raise ValueError(f"LoRA adapter name {module.name!r} is a name of the base model")
        lora = LoRARequest(module.name, self._next_id, module.path, module.base_model_name)
        self._next_id += 1
        return lora

    def load(self, module: LoRAModule) -> LoRARequest:
        """Check `module` (reading it) and serve it; a start-up adapter that does not fit raises ValueError."""
        lora = self.new_request(module)
        self.read(lora)
        self.add(lora)
        return lora

    def add(self, lora: LoRARequest) -> None:
        self.adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)
