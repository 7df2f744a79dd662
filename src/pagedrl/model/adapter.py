"""LoRA adapters on disk in PEFT's format, so `peft.PeftModel.from_pretrained` loads what pagedrl
saves and pagedrl loads what PEFT saves.

A folder holds `adapter_config.json` (PEFT's LoraConfig: `peft_type: LORA`, `r`, `lora_alpha`,
`target_modules`, `task_type`, `base_model_name_or_path`, ...) and `adapter_model.safetensors`,
whose keys are the adapted model's own names under `base_model.model.` without the adapter's name
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), and the full tensors of
`modules_to_save` the same way (`base_model.model.score.weight`). Adapters on a mixture of experts'
weights (`target_parameters`) take the names of PEFT's nested wrappers (`model/expert_lora.py`).
PEFT features pagedrl does not implement (DoRA, rsLoRA, per-layer ranks, bias training, ...) are
refused by name on load rather than silently ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.expert_lora import peft_names
from pagedrl.model.lora import (
    ALL_LINEAR,
    LoRAConfig,
    adapter_config,
    adapter_state_dict,
    apply_lora,
    lora_layers,
)
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.staging import staged_folder

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT options whose non-default value would change the model pagedrl builds: refused when set.
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
               "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
               "lora_bias": False, "exclude_modules": None, "trainable_token_indices": None}
# PEFT options that change what an adapter computes, refused when set (not written into a saved config,
# as the ones above are with their defaults: older PEFT versions do not know them).
REFUSED_IF_SET = ("alora_invocation_tokens", "layer_replication", "kasa_config", "use_bdlora", "arrow_config")
# A `target_modules` regular expression is tried on these layers' module names (PEFT full-matches it
# against every module's name): a projection it takes in some of them only is refused.
PROBE_LAYERS = (0, 1, 2, 7, 31)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def peft_config_dict(config: LoRAConfig, held: set[str] | None = None) -> dict[str, Any]:
    """`adapter_config.json` as PEFT writes it for this adapter; `held`: the projection names the model
    adapted ("all-linear" names the Llama layout's and Phi-3's fused ones; a file lists those it has)."""
    return {
        "peft_type": "LORA",
        "task_type": config.task_type,
        "base_model_name_or_path": config.base_model_name_or_path,
        "revision": config.revision,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": [t for t in config.resolved_targets() if held is None or t in held],
        "target_parameters": list(config.target_parameters) if config.target_parameters else None,
        "modules_to_save": list(config.modules_to_save) or None,
        "inference_mode": True,
        "init_lora_weights": True,
        **UNSUPPORTED,
    }


def write_adapter(model: nn.Module, folder: Path, tokenizer: Any = None) -> None:
    """Write the adapter `model` carries into `folder` (created if missing, not staged: a caller
    that publishes it, as a checkpoint does, stages the whole folder)."""
    config = adapter_config(model)
    if config is None:
        raise ValueError("write_adapter: the model carries no LoRA adapter")
    folder.mkdir(parents=True, exist_ok=True)
    held = {name.rpartition(".")[2] for name, _ in lora_layers(model)}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config_dict(config, held), indent=2) + "\n")
    renamed = peft_names(model)
    tensors = {PEFT_PREFIX + renamed.get(k, k): v.detach().to("cpu").contiguous()
               for k, v in adapter_state_dict(model).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(folder)


def save_adapter(model: nn.Module, folder: str | Path, tokenizer: Any = None) -> Path:
    """`write_adapter`, published atomically (a crash leaves no half-written folder)."""
    folder = Path(folder)
    with staged_folder(folder) as tmp:
        write_adapter(model, tmp, tokenizer)
    return folder


def read_adapter_config(folder: str | Path) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter folder; every problem names the file and the field."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_CONFIG}; not a PEFT adapter folder")
    data = path.read_bytes()
    try:
        raw = json.loads(data)  # JSON is UTF-8 (json.loads also reads a BOM, UTF-16 and UTF-32)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}: {e.reason}); "
                              "JSON files are UTF-8, so save it again as UTF-8 (a Latin-1 editor?)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {raw.get('peft_type')!r}; pagedrl loads LORA adapters only")
    for key, default in UNSUPPORTED.items():
        value = raw.get(key, default)
        if value not in (default, None) and not (isinstance(default, dict) and not value):
            raise CheckpointError(f"{path}: {key}={value!r} is not supported (only {default!r})")
    for key in REFUSED_IF_SET:
        if raw.get(key) not in (None, False, {}, []):
            raise CheckpointError(f"{path}: {key}={raw[key]!r} is not supported (only unset)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets == ALL_LINEAR or targets in LAYER_PROJECTIONS else regex_targets(targets, path)
    elif isinstance(targets, list):
        targets = [projection_of(t) if isinstance(t, str) else t for t in targets]
    parameters = raw.get("target_parameters")
    if isinstance(parameters, str):
        parameters = [parameters]
    task = raw.get("task_type") or "CAUSAL_LM"
    if task not in ("CAUSAL_LM", "SEQ_CLS"):
        raise CheckpointError(f"{path}: task_type {task!r}; pagedrl loads CAUSAL_LM and SEQ_CLS adapters")
    modules_to_save = list(raw.get("modules_to_save") or [])
    if task == "SEQ_CLS" and "score" not in modules_to_save:
        modules_to_save.append("score")  # PEFT adds the classifier head for this task itself
    try:
        return LoRAConfig(r=raw.get("r", 8), lora_alpha=float(raw.get("lora_alpha", 8)),
                          lora_dropout=float(raw.get("lora_dropout", 0.0)), target_modules=targets,
                          target_parameters=list(parameters) if parameters else None,
                          modules_to_save=modules_to_save, task_type=task,
                          base_model_name_or_path=raw.get("base_model_name_or_path"), revision=raw.get("revision"))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def projection_of(name: str) -> str:
    """A `target_modules` entry as the projection it names: PEFT matches an entry against the end of
    module names, so `self_attn.q_proj` or `mlp.up_proj` is that projection in every layer."""
    parent, _, last = name.rpartition(".")
    return last if last in LAYER_PROJECTIONS and parent == ("mlp" if last in MLP_PROJECTIONS else "self_attn") else name


def regex_targets(pattern: str, path: Path) -> list[str]:
    """The projections PEFT's `target_modules` regular expression selects (it is full-matched against
    module names such as `model.layers.3.self_attn.q_proj`) in every layer; one it selects in some layers
    only would be a per-layer choice (`layers_to_transform`'s), which is refused as that is."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"{path}: target_modules {pattern!r} is not a regular expression ({e})") from None
    targets = []
    for projection in LAYER_PROJECTIONS:
        parent = "mlp" if projection in MLP_PROJECTIONS else "self_attn"
        hits = [rx.fullmatch(f"model.layers.{i}.{parent}.{projection}") is not None for i in PROBE_LAYERS]
        if all(hits):
            targets.append(projection)
        elif any(hits):
            raise CheckpointError(f"{path}: target_modules {pattern!r} takes {projection} in some layers only; "
                                  "an adapter of some layers is not supported")
    if not targets:
        raise CheckpointError(f"{path}: target_modules {pattern!r} matches no decoder projection's name "
                              "(as model.layers.0.self_attn.q_proj)")
    return targets


def read_adapter_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the model's own names (PEFT's prefix removed)."""
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_WEIGHTS}")
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    out = {}
    for key, tensor in raw.items():
        if not key.startswith(PEFT_PREFIX):
            raise CheckpointError(f"{path}: tensor {key!r} does not start with {PEFT_PREFIX!r} (PEFT's layout)")
        out[key[len(PEFT_PREFIX):].replace(".default.", ".")] = tensor
    return out


def load_adapter_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy a saved adapter's tensors into the adapter `model` already carries (resuming)."""
    ours = {theirs: name for name, theirs in peft_names(model).items()}
    state = {ours.get(k, k): v for k, v in read_adapter_weights(folder).items()}
    expected = adapter_state_dict(model)
    path = Path(folder) / ADAPTER_WEIGHTS
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and any("lm_head" in k for k in state):
        raise CheckpointError(f"{path}: the adapter trains lm_head (modules_to_save), which this model ties to "
                              "embed_tokens; pagedrl loads such an adapter on an untied base only (PEFT keeps a "
                              "separate copy of the head)")
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of this adapter: another "
                                  "rank, target_modules or model?)")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the adapter "
                                  f"{tuple(expected[name].shape)}")
    missing = [n for n in expected if n not in state]
    if missing:
        raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in state.items():
            params[name].copy_(tensor)


def load_adapter(model: nn.Module, folder: str | Path) -> LoRAConfig:
    """Put the adapter of `folder` on `model` (a base model without one) and load its weights."""
    config = read_adapter_config(folder)
    apply_lora(model, config)
    load_adapter_weights(model, folder)
    return config
