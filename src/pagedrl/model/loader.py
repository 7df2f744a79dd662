"""One entry point from a model name to weights and tokenizer: a Hugging Face folder, a GGUF file
(converted once into the cache) or the embedded default's name."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.checkpoint import CheckpointError, load_causal_lm
from pagedrl.model.decoder import CausalLM
from pagedrl.model.default import DEFAULT_MODEL, cache_dir, resolve_default_model
from pagedrl.model.gguf import ensure_converted
from pagedrl.model.precision import Precision, resolve_dtype
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


def resolve_model_path(model: str | Path | None) -> Path:
    """The Hugging Face folder behind a model argument; GGUF files are converted once and cached."""
    if model is None or str(model) == DEFAULT_MODEL:
        return resolve_default_model()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: GGUF file not found")
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return ensure_converted(path, cache_dir() / "gguf" / f"{path.stem}-{key}")
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder or file (expected a Hugging Face folder, a .gguf "
                              f"file or {DEFAULT_MODEL!r})")
    return path


def load_model(model: str | Path | None = None, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, load_tokenizer: bool = True,
               adapter: str | Path | None = None) -> LoadedModel:
    """`model` with, if given, a LoRA `adapter` folder folded into its weights (`model` None: the
    base the adapter names; `model` an adapter folder: the same); the tokenizer is the adapter
    folder's when it holds one. `dtype` None or "auto": the device's default (`model/precision.py`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = resolve_dtype(dtype, device)
    if adapter is None and model is not None and (Path(model).expanduser() / "adapter_config.json").is_file():
        adapter, model = model, None  # an adapter folder alone (a LoRA run's final/): on the base it names
    tokenizer_dir = None
    if adapter is not None:
        from pagedrl.model.merge import adapter_base, merged_causal_lm

        path = adapter_base(adapter, model)
        net = merged_causal_lm(path, adapter, device=device, dtype=precision.dtype)
        tokenizer_dir = Path(adapter) if (Path(adapter) / "tokenizer.json").is_file() else None
    else:
        path = resolve_model_path(model)
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
