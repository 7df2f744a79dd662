"""One entry point from a model name to weights and tokenizer: whatever `model/resolve.py` accepts
(a Hugging Face folder, a Hub id, a GGUF file, the embedded default's name), with a LoRA adapter
folded in when one is named."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.adapter import is_adapter_folder
from pagedrl.model.checkpoint import CheckpointError, load_causal_lm
from pagedrl.model.decoder import CausalLM
from pagedrl.model.merge import merged_causal_lm
from pagedrl.model.precision import Precision, resolve_dtype
from pagedrl.model.resolve import adapter_base, resolve_model_path
from pagedrl.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    path: Path
    precision: Precision  # the dtype the weights were loaded in, and why
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id")
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return sorted(set(ids) | set(self.model.config.eos_token_ids))


def load_model(model: str | Path | None = None, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, load_tokenizer: bool = True,
               adapter: str | Path | None = None, revision: str | None = None) -> LoadedModel:
    """`model` (at `revision` if it is a Hub id) with, if given, a LoRA `adapter` (a folder or a Hub
    id) folded into its weights (`model` None: the base the adapter names; `model` an adapter: the
    same); the tokenizer is the adapter folder's when it holds one. `dtype` None or "auto": the
    device's default (`model/precision.py`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = resolve_dtype(dtype, device)
    path = None if model is None and adapter is not None else resolve_model_path(model, revision)
    if adapter is None and path is not None and is_adapter_folder(path):
        adapter, path = path, None  # an adapter alone (a LoRA run's final/): on the base it names
    tokenizer_dir = None
    if adapter is not None:
        adapter = resolve_model_path(adapter)
        path = adapter_base(adapter, path)
        net = merged_causal_lm(path, adapter, device=device, dtype=precision.dtype)
        tokenizer_dir = adapter if (adapter / "tokenizer.json").is_file() else None
    else:
        net = load_causal_lm(path, device=device, dtype=precision.dtype)
    tokenizer_dir = tokenizer_dir or path
    tokenizer = Tokenizer.from_folder(tokenizer_dir) if load_tokenizer and (tokenizer_dir / "tokenizer.json").is_file() \
        else None
    gen_path = path / "generation_config.json"
    gen: dict[str, Any] = {}
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{gen_path}: not valid JSON ({e})") from None
    return LoadedModel(net, tokenizer, path, precision, gen)
