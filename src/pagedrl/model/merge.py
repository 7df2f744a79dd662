"""A base model plus a LoRA adapter folder, as one ordinary model: what `LLM(model, adapter=...)`,
`pagedrl serve --adapter` and `pagedrl merge` build.

The adapter is folded into the base weights (W + s·B A) once at load time, so serving an adapter
costs exactly what serving its base costs. A causal-LM adapter gives a `CausalLM`; a SEQ_CLS one
(a `pagedrl rm --use_peft` reward model, a PPO critic) gives a `SequenceScorer` whose `score` head
is the adapter's. When no base is named, the adapter's `base_model_name_or_path` is used.

A QLoRA adapter (trained with `load_in_4bit` / `load_in_8bit`) records, as PEFT's does, only its float
base; given `quantized` (how the base was held), the base's projections are quantized and dequantized
again before the adapter is added, as PEFT merges into a quantized layer: the merged model computes
what the trained one computed. Without it the adapter is added to the float weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedrl.model.adapter import is_adapter_folder, load_adapter, read_adapter_config
from pagedrl.model.checkpoint import CheckpointError, default_dtype, load_causal_lm, save_checkpoint
from pagedrl.model.heads import SequenceScorer, load_sequence_scorer, save_sequence_scorer
from pagedrl.model.lora import merge_lora
from pagedrl.model.qlora_gguf import quantize_base
from pagedrl.model.quantized_linear import QuantizedBase, dequantize_projections
from pagedrl.model.resolve import adapter_base, resolve_model_path

Source = tuple[str | Path, str | None]  # a model argument and its revision


def _fold(model: torch.nn.Module, adapter: Path, quantized: QuantizedBase | None, source: Source) -> torch.nn.Module:
    """`model` (loaded from `source`) with the adapter folded in (on its dequantized base under
    `quantized`, a GGUF's own blocks kept as the trainer kept them)."""
    if quantized is not None:
        quantize_base(model, quantized, *source)
    load_adapter(model, adapter)
    merge_lora(model)
    dequantize_projections(model)
    return model


def _source(base: str | Path | None, source: Source | None, adapter: Path, revision: str | None = None) -> Source:
    """The model argument the base came from (a `.gguf` file before its conversion to a folder) and its
    revision: where a QLoRA base keeps the file's blocks."""
    if source is not None:
        return source
    if base is not None:
        return base, revision
    config = read_adapter_config(adapter)
    return config.base_model_name_or_path, config.revision


def merged_causal_lm(base: str | Path | None, adapter: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, quantized: QuantizedBase | None = None,
                     source: Source | None = None) -> torch.nn.Module:
    """The base causal LM with the adapter folded in (computed in float32, then cast to `dtype`).
    `source`: the model argument `base` was resolved from and its revision, when it was."""
    adapter = resolve_model_path(adapter)
    config = read_adapter_config(adapter)
    if config.task_type != "CAUSAL_LM":
        raise CheckpointError(f"{adapter}: a {config.task_type} adapter (a reward model or critic), not a causal LM's")
    model = load_causal_lm(adapter_base(adapter, base), device=device, dtype=torch.float32)
    return _fold(model, adapter, quantized, _source(base, source, adapter)).to(dtype or default_dtype(device)).eval()


def merged_scorer(base: str | Path | None, adapter: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, quantized: QuantizedBase | None = None,
                  _chain: tuple[Path, ...] = (), source: Source | None = None,
                  float_head: bool = False) -> SequenceScorer:
    """The base backbone with the adapter folded in and the adapter's `score` head (kept in float32 with
    `float_head`, `SequenceScorer.cast`)."""
    adapter = resolve_model_path(adapter)
    config = read_adapter_config(adapter)
    if config.task_type != "SEQ_CLS":
        raise CheckpointError(f"{adapter}: a {config.task_type} adapter, not a reward model's (SEQ_CLS)")
    base_path = adapter_base(adapter, base)
    if is_adapter_folder(base_path):  # a LoRA PPO critic's base: a LoRA reward model, folded in first
        chain = (*_chain, adapter.resolve())
        if base_path.resolve() in chain:
            raise CheckpointError(f"{adapter}: adapter_config.json's base leads back to an adapter already on the way "
                                  f"({' -> '.join(map(str, (*chain, base_path.resolve())))}); name a model folder")
        model: SequenceScorer = merged_scorer(None, base_path, device=device, dtype=torch.float32, _chain=chain)
    else:  # the base's own head (if a classifier) or a placeholder one: the adapter's `score` replaces it
        model = load_sequence_scorer(base_path, device=device, dtype=torch.float32,
                                     generator=torch.Generator().manual_seed(0))
    folded = _fold(model, adapter, quantized, _source(base, source, adapter))
    assert isinstance(folded, SequenceScorer)
    return folded.cast(device, dtype or default_dtype(device), float_head).eval()


def load_reward_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                      float_head: bool = False, any_labels: bool = False) -> SequenceScorer:
    """A trained reward model: a classifier folder (of several labels too with `any_labels`), or a SEQ_CLS
    adapter merged into the base it names."""
    if is_adapter_folder(path):
        return merged_scorer(None, path, device=device, dtype=dtype, float_head=float_head)
    return load_sequence_scorer(path, device=device, dtype=dtype, new_head=False, float_head=float_head,
                                any_labels=any_labels)


def merge_adapter(base: str | Path | None, adapter: str | Path, out: str | Path, revision: str | None = None,
                  quantized: QuantizedBase | None = None) -> Path:
    """Write base (at `revision` if a Hub id) + adapter as one Hugging Face folder at `out`, published
    whole or not at all (`save_checkpoint` stages it), with the adapter's tokenizer files if it has
    them, else the base's."""
    adapter = resolve_model_path(adapter)
    base_path = adapter_base(adapter, base, revision)
    tokenizer_dir = adapter if (adapter / "tokenizer.json").is_file() else base_path
    if read_adapter_config(adapter).task_type == "SEQ_CLS":
        scorer = merged_scorer(base_path, adapter, dtype=torch.float32, quantized=quantized,
                               source=_source(base, None, adapter, revision))
        return save_sequence_scorer(scorer, out, tokenizer_dir=tokenizer_dir)
    generation = base_path / "generation_config.json"
    try:
        extra = json.loads(generation.read_text()) if generation.is_file() else None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{generation}: not valid JSON ({e})") from None
    model = merged_causal_lm(base_path, adapter, dtype=torch.float32, quantized=quantized,
                             source=_source(base, None, adapter, revision))
    return save_checkpoint(model, out, tokenizer_dir=tokenizer_dir, generation_config=extra)
