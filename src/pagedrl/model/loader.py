"""One entry point from a model name to weights and tokenizer: whatever `model/resolve.py` accepts
(a Hugging Face folder, a Hub id, a GGUF file, the embedded default's name), with a LoRA adapter
folded in when one is named."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.adapter import is_adapter_folder
from pagedrl.model.checkpoint import CheckpointError, load_causal_lm
from pagedrl.model.decoder import CausalLM
from pagedrl.model.gguf_modules import use_int8_activations
from pagedrl.model.gguf_quantized import load_gguf_quantized
from pagedrl.model.merge import merged_causal_lm
from pagedrl.model.mxfp4_loading import load_mxfp4_kept
from pagedrl.model.precision import ACTIVATIONS, QUANTIZATIONS, Precision, resolve_dtype
from pagedrl.model.prequantized import describe as describe_prequantized
from pagedrl.model.prequantized import load_prequantized
from pagedrl.model.prequantized_config import PREQUANTIZED, quant_method
from pagedrl.model.resolve import adapter_base, resolve_gguf, resolve_model_path
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.model.weight_only import WEIGHT_ONLY, describe, quantize_weights

logger = logging.getLogger(__name__)


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
               adapter: str | Path | None = None, revision: str | None = None,
               quantization: str | None = None, activations: str = "float32") -> LoadedModel:
    """`model` (at `revision` if it is a Hub id) with, if given, a LoRA `adapter` (a folder or a Hub
    id) folded into its weights (`model` None: the base the adapter names; `model` an adapter: the
    same); the tokenizer is the adapter folder's when it holds one. `dtype` None or "auto": the
    device's default (`model/precision.py`). `quantization="gguf"`: a GGUF's quantized weights stay
    quantized (`model/gguf_quantized.py`); `"int8"` / `"int4"`: the float weights quantized at load
    (`model/weight_only.py`); `"mxfp4"`: a gpt-oss checkpoint's MXFP4 experts kept so (`model/mxfp4_loading.py`).
    `activations="int8"` (with a quantization, on a CPU): the Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K projections' engine products
    on 8-bit activations, as llama.cpp computes them (`gguf_modules.use_int8_activations`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if activations == "int8" and device.type != "cpu":
        raise _int8_needs(quantization, device)
    if quantization is not None:
        loaded = _load_quantized(model, device, dtype, load_tokenizer, adapter, revision, quantization)
        return loaded if activations == "float32" else _int8_activations(loaded)
    precision = resolve_dtype(dtype, device)
    path = None if model is None and adapter is not None else resolve_model_path(model, revision)
    if path is not None and (method := quant_method(path)) in PREQUANTIZED:  # (as vLLM: the config names it)
        loaded = _load_quantized(path, device, dtype, load_tokenizer, adapter, revision, method)
        return loaded if activations == "float32" else _int8_activations(loaded)
    if activations == "int8":  # (only now: a pre-quantized folder's config names its quantization)
        raise _int8_needs(quantization, device)
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
    tokenizer = _tokenizer(tokenizer_dir) if load_tokenizer else None
    return LoadedModel(net, tokenizer, path, precision, _generation_config(path))


def _int8_needs(quantization: str | None, device: torch.device) -> ValueError:
    return ValueError(f"activations='int8' multiplies quantized weights on a CPU's integer dot products; it needs "
                      f"quantization (gguf, int8 or int4) and a CPU device, got quantization={quantization!r} on "
                      f"{device.type} (a pre-quantized folder, gptq / awq / compressed-tensors, names its own)")


def _tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's tokenizer.json; None without one, saying so where the folder holds another
    tokenizer's files (a slow tokenizer's vocabulary: text prompts will be refused)."""
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_folder(folder)
    slow = [name for name in ("tokenizer.model", "vocab.json", "tiktoken.model") if (folder / name).is_file()]
    if slow:
        logger.warning("%s: no tokenizer.json (it has %s), so only token ids can be given as prompts; write one with "
                       "transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)", folder, slow[0])
    return None


def _generation_config(path: Path) -> dict[str, Any]:
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return {}
    try:
        return json.loads(gen_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{gen_path}: not valid JSON ({e})") from None


def _int8_activations(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with its Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / K-quant projections on 8-bit activations, said in its precision's reason;
    refused where it has none."""
    turned = use_int8_activations(loaded.model)
    if not turned:
        raise ValueError(f"activations='int8': {loaded.path} has no Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K projection to "
                         "multiply on 8-bit activations (its types keep float32 activations); drop activations='int8'")
    listed = ", ".join(f"{name} x {n}" for name, n in sorted(turned.items()))
    reason = f"{loaded.precision.reason}; 8-bit activations (llama.cpp's arithmetic) for {listed}"
    loaded.precision = Precision(loaded.precision.dtype, reason)
    return loaded


def _load_quantized(model: str | Path | None, device: torch.device, dtype: torch.dtype | str | None,
                    load_tokenizer: bool, adapter: str | Path | None, revision: str | None,
                    quantization: str) -> LoadedModel:
    """A GGUF with its quantized weights kept quantized, or any model's weights quantized at load to int8 /
    int4; each setting it cannot honour refused in one line."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)} "
                         "(gguf: a GGUF file's own quant types kept quantized; int8, int4: weight-only, made at load; "
                         "mxfp4: gpt-oss's published MXFP4 experts kept so; gptq, awq, compressed-tensors: a "
                         "pre-quantized folder's packed weights kept quantized)")
    if adapter is not None:
        raise ValueError(f"quantization={quantization!r} with a LoRA adapter folded in is not supported: a quantized "
                         "base cannot hold merged weights (serve the adapter per request on the quantized base with enable_lora / "
                         "--enable-lora, or drop quantization)")
    if device.type == "cpu" and dtype not in (None, "auto", "float32", "float", torch.float32):
        raise ValueError(f"quantization={quantization!r} computes in float32 on a CPU (its kernels' products are the "
                         f"float32 model's); dtype={dtype!r} is not supported with it there")
    precision = resolve_dtype("float32" if device.type == "cpu" else dtype, device)
    if quantization in (*WEIGHT_ONLY, *PREQUANTIZED):
        path = resolve_model_path(model, revision)
        found = quant_method(path)
        if found is not None and found != quantization and found != "mxfp4":
            raise ValueError(f"quantization={quantization!r} does not agree with {path / 'config.json'}'s "
                             f"quantization_config.quant_method {found!r} (drop quantization, or name {found!r})")
        if found is None and quantization in PREQUANTIZED:
            raise ValueError(f"quantization={quantization!r} reads a pre-quantized folder; {path / 'config.json'} has "
                             "no quantization_config (int8 / int4 quantize a float folder at load)")
    if quantization in PREQUANTIZED:
        net, scheme, held = load_prequantized(path)
        reason = describe_prequantized(scheme, held, device)
    elif quantization in WEIGHT_ONLY:
        if is_adapter_folder(path):
            raise ValueError(f"quantization={quantization!r}: {path} is a LoRA adapter; a quantized base cannot hold "
                             "merged weights (name the base model and serve the adapter per request with enable_lora / --enable-lora, "
                             "or drop quantization)")
        net = load_causal_lm(path, device="cpu", dtype=torch.float32)
        reason = describe(quantization, quantize_weights(net, quantization), device)
    elif quantization == "mxfp4":
        if str(model).endswith(".gguf"):  # (resolving it would convert it to a float folder)
            raise ValueError(f"quantization='mxfp4' keeps a gpt-oss checkpoint folder's MXFP4 experts; {model} is not "
                             "a folder (a gpt-oss GGUF keeps them with quantization='gguf')")
        path = resolve_model_path(model, revision)
        net, kept = load_mxfp4_kept(path)
        reason = "gpt-oss experts kept in MXFP4: " + ", ".join(f"{name} x {n}" for name, n in sorted(kept.items()))
    else:
        found = resolve_gguf(model, revision)
        if found is None:
            raise ValueError(f"quantization='gguf' needs a GGUF file; {model} is a folder (name a .gguf file, "
                             "org/repo/file.gguf, or the default model; int8 / int4 quantize a folder at load)")
        source, path = found  # the file, and its converted folder: config, tokenizer, generation config
        net, kept = load_gguf_quantized(source, path)
        reason = "GGUF weights kept quantized: " + ", ".join(f"{name} x {n}" for name, n in sorted(kept.items()))
    net = net.to(device=device, dtype=precision.dtype)
    loaded = LoadedModel(net, None, path, Precision(precision.dtype, reason), _generation_config(path))
    if load_tokenizer:
        loaded.tokenizer = _tokenizer(path)
    return loaded
