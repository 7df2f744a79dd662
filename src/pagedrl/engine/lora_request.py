"""Which LoRA adapter a request runs with: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

`lora_int_id` is the adapter's identity inside the engine (its resident slot, its CPU copy and its
prefix-cache key are found by it), so two different adapters must never share one; the name is what
users and the server call it. A request without one runs on the base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path: adapter {self.lora_name!r} needs the folder (or Hub id) "
                             "of a PEFT adapter")

    @cached_property  # read for every running sequence every step: made once
    def cache_salt(self) -> bytes:
        """Mixed into the first block hash of its sequences: KV computed under one adapter is never
        found for another, nor for the base."""
        return b"lora:%d" % self.lora_int_id
