"""Hugging Face checkpoint folders: read what transformers and vLLM publish, write what they read.

A folder holds `config.json`, one `model.safetensors` or shards named by `model.safetensors.index.json`,
tokenizer files and `generation_config.json`. Every failure names the file and what was wrong, because a
stack trace from inside safetensors tells a user nothing about which of their files is broken.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pagedrl.model import expert_weights, mxfp4
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.deepseek import ROUTER_FLOAT32
from pagedrl.model.footprint import check_fits, footprint
from pagedrl.model.precision import choose_precision
from pagedrl.model.prequantized_config import PrequantizedError, check_float_load
from pagedrl.model.staging import staged_folder

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CACHE_LINE = 64  # bytes: a cache line, and one AVX512 vector


class CheckpointError(ValueError):
    """A checkpoint folder or file pagedrl cannot load; the message names the file."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or the single file."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name}, which is missing from {folder}")
        return files
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    hint = (f" (it holds {pickled[0]}: pickled PyTorch weights, which pagedrl does not unpickle; convert them "
            "with transformers' save_pretrained(..., safe_serialization=True))") if pickled else ""
    raise CheckpointError(f"{folder}: no {WEIGHTS_NAME}, {INDEX_NAME} or *.safetensors file{hint}")


def read_state_dict(folder: Path, dtype: torch.dtype = torch.float32,
                    origins: dict[str, str] | None = None, float32: tuple[str, ...] = (),
                    keep_mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a folder, the floating ones in `dtype` except those whose names end with one of
    `float32`, read in float32 whatever `dtype` says (DeepSeek's router); MXFP4 pairs (`W_blocks`,
    `W_scales`: gpt-oss's published experts) dequantized into `W` in `dtype` (`model/mxfp4.py`).
    `origins`, if given, receives the file each tensor came from. `keep_mxfp4`: the pairs as they are
    (`model/mxfp4_loading.py` keeps them quantized)."""
    state: dict[str, torch.Tensor] = {}
    origins = origins if origins is not None else {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point():
                        tensor = tensor.to(torch.float32 if name.endswith(float32) else dtype)
                    state[name] = cache_line_aligned(tensor)
                    origins[name] = str(path)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    if keep_mxfp4:
        return state
    try:
        return mxfp4.dequantize_state(state, dtype, origins, str(folder))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def cache_line_aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it that starts on a cache line. safetensors hands each tensor over in a
    buffer of its own that starts 40 bytes past a line; a float32 weight kept as read (the dtype it
    is stored in) then has half of its AVX2 loads and every AVX512 load straddle two lines, and the
    CPU kernels' products of a decode step's few rows ran 25-35% slower on it (`bench/RESULTS.md`).
    torch's own allocations start on a line (a cast already copies)."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % CACHE_LINE == 0 or tensor.numel() == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def without_next_token_layers(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's published checkpoints carry its multi-token-prediction module as layers past the
    last (`model.layers.61.*`); transformers skips them on load, and so does pagedrl (it decodes one
    token a step)."""
    def beyond(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers

    return {k: v for k, v in state.items() if not beyond(k)}


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                 origins: dict[str, str] | None = None, assign: bool = False) -> None:
    """Copy a state dict into the model, checking names and shapes against the config first. A
    mixture of experts' per-expert tensors are stacked as the model holds them (`model/expert_weights.py`).
    `assign`: the state's tensors become the model's (a model built on the meta device)."""
    origins = origins if origins is not None else {}
    expected = model.state_dict()
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    if isinstance(config, ModelConfig):
        if config.deepseek is not None:
            state = without_next_token_layers(state, config.num_hidden_layers)
        try:
            state = expert_weights.from_disk(state, config, origins)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
    for name, tensor in state.items():
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"{origins.get(name, source)}: unexpected tensor {name!r} (not part of this architecture)")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{origins.get(name, source)}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)} (inconsistent config and weights)"
            )
    missing = [n for n in expected if n not in state and not (tied and n == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{source}: missing tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=assign)


def read_folder_config(folder: Path) -> ModelConfig:
    """The `config.json` of a checkpoint folder, every problem reported as a CheckpointError."""
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a GGUF file is loaded by file name ending in .gguf)")
    try:
        return ModelConfig.from_file(folder / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_causal_lm(folder: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> CausalLM:
    """Build a CausalLM from a Hugging Face folder."""
    folder = Path(folder)
    cfg = read_folder_config(folder)
    try:
        check_float_load(folder)
    except PrequantizedError as e:
        raise CheckpointError(str(e)) from None
    dtype = dtype or default_dtype(device)
    device = torch.device(device)
    fp = footprint(cfg, dtype)
    check_fits(fp, device, str(folder))
    if device.type != "cpu":
        check_fits(fp, torch.device("cpu"), f"{folder} (read into host memory first)")
    # Built on the meta device so no time goes into random initialisation of weights we overwrite, and
    # no memory: the tensors read from the files (in the precision the model will hold) become its
    # parameters, so loading holds the weights once, not a float32 copy beside them. The rope buffer
    # is recomputed and the tie restored, since assigning replaces both.
    with torch.device("meta"):
        model = CausalLM(cfg)
    origins: dict[str, str] = {}
    float32 = ROUTER_FLOAT32 if cfg.deepseek is not None else ()
    load_weights(model, read_state_dict(folder, dtype=dtype, origins=origins, float32=float32), str(folder), origins,
                 assign=True)
    model.model.reset_rope()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device).eval()


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs that compute it natively, float32 elsewhere (`model/precision.py`)."""
    return choose_precision(device).dtype


def save_checkpoint(model: CausalLM, folder: str | Path, *, tokenizer_dir: str | Path | None = None,
                    generation_config: dict[str, Any] | None = None, max_shard_bytes: int | None = None,
                    extra_config: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a Hugging Face folder atomically: everything goes to a temporary sibling first and is
    renamed into place at the end, so a crash never leaves a folder that looks complete."""
    folder = Path(folder)
    with staged_folder(folder) as tmp:
        tensors = state if state is not None else model.state_dict()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()
                   if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
        cfg = model.config.to_dict()
        cfg.pop("torch_dtype", None)  # transformers 5's name is `dtype`; one field, never two that disagree
        cfg.pop("quantization_config", None)  # the tensors written are float, whatever the source held
        cfg["dtype"] = saved_dtype(tensors) or cfg.get("dtype")
        cfg.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors = expert_weights.to_disk(tensors, model.config)  # one tensor per expert, as published
        write_safetensors(tensors, tmp, max_shard_bytes)
        gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}
        gen.update(generation_config or {})
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
    return folder


def saved_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    """config.json's `dtype` for these tensors: the floating dtype holding most of their elements
    (what save_pretrained records: the dtype the weights are in, which a trained model's float32
    masters make float32 whatever its base said); None without floating tensors."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return str(max(counts, key=counts.__getitem__)).removeprefix("torch.") if counts else None


def write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
