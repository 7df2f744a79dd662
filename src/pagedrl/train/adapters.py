"""LoRA in the trainers (`use_peft`): what every algorithm does the same way when it trains adapters
on a frozen base instead of every weight.

- `attach_lora` puts adapters on a freshly loaded model, drawn from the run's seed (a resumed run
  then overwrites them from its checkpoint), and records the base model's name in the adapter.
- The reference of DPO, GRPO (beta > 0) and PPO is the base itself: `reference_forward(model)`
  switches the adapters off for a no-grad pass, so no second copy of the weights is ever made.
- `save_model` / `load_model` of an algorithm write and read the adapter in PEFT's format
  (`adapter_config.json`, `adapter_model.safetensors`, and the tokenizer): checkpoints hold the
  adapter and the trainer state, and the frozen base comes from `config.model` again on resume.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pagedrl.model.lora import LoRAConfig, adapter_config, apply_lora, disable_adapter, lora_layers
from pagedrl.model.qlora_gguf import quantize_base
from pagedrl.model.quantized_linear import quantized_layers
from pagedrl.train.config import TrainConfig

CAUSAL_LM, SEQ_CLS = "CAUSAL_LM", "SEQ_CLS"


def lora_config(config: TrainConfig, task_type: str = CAUSAL_LM, modules_to_save: Sequence[str] = (),
                base: str | None = None) -> LoRAConfig:
    """The adapter a run's `lora_*` fields describe; without dropout where the config disables it (TRL's
    DPO and reward trainers do by default, and PEFT's dropout with the rest). `base`: the model the
    adapter goes on when it is not `config.model` (a PPO critic's reward model), recorded as PEFT's
    `base_model_name_or_path` so that the adapter is loaded on the weights it was trained on."""
    dropout = 0.0 if getattr(config, "disable_dropout", False) else config.lora_dropout
    return LoRAConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=dropout,
                      target_modules=config.lora_target_modules,
                      target_parameters=config.lora_target_parameters, modules_to_save=list(modules_to_save),
                      task_type=task_type, base_model_name_or_path=str(config.model) if base is None else base,
                      revision=config.revision if base is None else None)


def attach_lora(config: TrainConfig, model: nn.Module, task_type: str = CAUSAL_LM,
                modules_to_save: Sequence[str] = (), seed_offset: int = 0, base: str | None = None) -> nn.Module:
    """With `use_peft`: adapters on `model` (in place), base frozen (and, with `load_in_4bit` /
    `load_in_8bit`, its projections quantized first: QLoRA); without it `model` as it is."""
    if not config.use_peft:
        return model
    spec = config.quantized_base
    if spec is not None and not quantized_layers(model):
        quantize_base(model, spec, config.model if base is None else base, config.revision if base is None else None)
    generator = torch.Generator().manual_seed(config.seed + 7919 * (1 + seed_offset))
    return apply_lora(model, lora_config(config, task_type, modules_to_save, base), generator)


def uses_lora(model: nn.Module) -> bool:
    return adapter_config(model) is not None


@contextlib.contextmanager
def reference_forward(model: nn.Module) -> Iterator[None]:
    """No-grad forwards of the base: the adapters of `model` off for the block."""
    with torch.no_grad(), disable_adapter(model):
        yield


def describe(model: nn.Module) -> str:
    """One summary line: rank, scaling, targets and how few parameters train."""
    c = adapter_config(model)
    assert c is not None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    quantized = quantized_layers(model)
    held = sum(layer.in_features * layer.out_features for layer in quantized)
    total = sum(p.numel() for p in model.parameters()) + held
    extra = f" + {', '.join(c.modules_to_save)} (whole)" if c.modules_to_save else ""
    adapted = {name.rpartition(".")[2] for name, _ in lora_layers(model)}  # (all-linear names every family's)
    targets = [*(t for t in c.resolved_targets() if t in adapted), *(c.target_parameters or [])]
    base = "the base frozen"
    if quantized:
        nbytes = sum(b.numel() * b.element_size() for layer in quantized for b in layer.buffers())
        kinds = Counter(layer.storage for layer in quantized)
        base += (f", its {len(quantized)} projections quantized ({'; '.join(f'{n} in {k}' for k, n in kinds.items())}: "
                 f"{nbytes / 2**20:.1f} MiB for {held / 1e6:.1f}M weights)")
    return (f"lora: r={c.r}, alpha={c.lora_alpha:g} (scaling {c.scaling:g}), dropout {c.lora_dropout:g} on "
            f"{', '.join(targets)}{extra}; {trained / 1e6:.2f}M of {total / 1e6:.1f}M parameters trained, "
            f"{base}")


def summary(module: nn.Module) -> list[str]:
    """A line per adapted model inside `module` (PPO's policy and critic each carry one)."""
    return [describe(m) for m in module.modules() if uses_lora(m)]


def base_storage(module: nn.Module) -> dict[str, int]:
    """How many frozen projections of `module` (a PPO policy and critic together) are held in each
    storage ("nf4 blocks of 64", "the GGUF file's own Q4_1 blocks", ...); empty for a float base."""
    return dict(Counter(layer.storage for layer in quantized_layers(module)))


def check_same_base(saved: dict[str, int] | None, module: nn.Module, folder: object) -> None:
    """A QLoRA run resumes on the base its adapters were trained on: the same settings can hold a GGUF's
    projections in its own blocks or in NF4 (`bnb_4bit_quant_type` unset or set), and the adapters of one
    on the other would train on other weights without a word. Checkpoints that do not say pass."""
    current = base_storage(module)
    if saved is not None and saved != current:
        raise ValueError(f"resume_from_checkpoint: {folder} trained on a base held as {saved or 'float'}, this run "
                         f"holds it as {current or 'float'}; resume with the quantization settings it was written "
                         "with (load_in_4bit / load_in_8bit, bnb_4bit_quant_type)")
