"""Tiny pre-quantized checkpoints written by the methods' own packers, never pagedrl's: compressed-tensors'
compressor (its `ModelCompressor`, from scales its `calculate_qparams` chose), and GPTQModel's pure-torch
packing functions (`gptqmodel/quantization/awq/utils/packing_utils.py`, loaded as that one file from a
folder off the import path: the package's import pulls its GPU stack) for AWQ's GEMM layout and GPTQ's.

The AWQ and GPTQ writers quantize round-to-nearest with fp16 scales, keeping the integer codes they packed,
so that the expected weights are those codes' float64 arithmetic, independent of any unpacker."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file
from tiny import FAMILIES, hf_model

FAMILY = "llama-gqa-untied"  # hidden 64, intermediate 96: inputs in groups of 32 and of 96


GPTQMODEL = Path(sys.prefix) / "gptqmodel-files"  # (Makefile) off the import path: peft and transformers
# take an importable gptqmodel for its whole GPU stack, and import it


def packing_utils() -> ModuleType:
    """GPTQModel's packing_utils.py, loaded as the one file it is (it imports only torch and math)."""
    path = GPTQMODEL / "gptqmodel/quantization/awq/utils/packing_utils.py"
    assert path.is_file(), f"{path}: missing; `make setup` installs gptqmodel there"
    spec = importlib.util.spec_from_file_location("gptqmodel_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def projections(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def write_compressed_tensors(folder: Path, fmt: str, bits: int, symmetric: bool, strategy: str,
                             group: int | None = None, seed: int = 1, base: str = FAMILY) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = hf_model(FAMILIES[base], seed=seed).half()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in projections(model).values():
        w = module.weight.detach()
        groups = w.view(w.shape[0], -1, group) if strategy == "group" else w[:, None, :]
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


def rtn_codes(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """w [n, k] quantized round-to-nearest: (codes [k, n] in 0..2^bits-1, zeros [groups, n], scales
    [groups, n] fp16), GPTQ's and AWQ's orientation."""
    top = (1 << bits) - 1
    g = w.double().T.reshape(-1, group, w.shape[0])  # [groups, group, n]
    low, high = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(-low, high) / (top // 2 + 0.5)).half().double().clamp(min=1e-4)
        zeros = torch.full_like(scales, (top + 1) // 2)
    else:
        scales = ((high - low) / top).half().double().clamp(min=1e-4)
        zeros = (-low / scales).round().clamp(0, top)
    codes = (g / scales[:, None] + zeros[:, None]).round().clamp(0, top)
    return codes.reshape(-1, w.shape[0]).int(), zeros.int(), scales.half()


def write_packed(folder: Path, method: str, bits: int = 4, group: int = 32, symmetric: bool = False,
                 desc_act: bool = False, seed: int = 1, base: str = FAMILY, modules: dict[str, dict | None] | None = None,
                 lm_head: bool = False, config: dict | None = None, **family: object) -> dict[str, torch.Tensor]:
    """A folder in AWQ's GEMM or GPTQ's layout, packed by GPTQModel (`base`: the tiny family, `family`:
    config fields over its own); returns each projection's expected weight [n, k] in float64 (scale * (code - zero), of the
    codes packed). GPTQ: `modules` gives a module its own bits / group / symmetric / desc_act (None: left
    float, as GPTQModel's `dynamic` "-:" rules leave it), `lm_head` packs the head too, and `config` adds
    quantization_config fields (its `dynamic`: these settings as GPTQModel writes them)."""
    packing = packing_utils()
    model = hf_model(dict(FAMILIES[base], **family), seed=seed).half()
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # (the embedding's, as save_pretrained leaves it)
    expected: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    defaults = dict(bits=bits, group=group, symmetric=symmetric, desc_act=desc_act)
    packed = {**projections(model), **({"lm_head": model.lm_head} if lm_head else {})}
    for name, module in packed.items():
        own = (modules or {}).get(name, defaults)
        if own is None:
            continue
        b, g, sym, act = (dict(defaults, **own)[key] for key in ("bits", "group", "symmetric", "desc_act"))
        n, k = module.weight.shape
        order = torch.randperm(k, generator=gen) if act else torch.arange(k)
        codes, zeros, scales = rtn_codes(module.weight.detach()[:, order], b, g, sym)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // g  # input order[i] is in group i // g
        codes = codes[torch.argsort(order)]  # back to input order
        expected[name] = (scales.double()[g_idx.long()] * (codes - zeros[g_idx.long()]).double()).T
        state.pop(f"{name}.weight", None)  # (a tied head has none)
        if method == "awq":
            qweight, qzeros = packing.pack_awq(codes, zeros, b)
        else:  # GPTQ's own format stores each zero point minus one (its kernels add it back)
            qweight, qzeros = packing.pack_exllama(codes, (zeros - 1) & ((1 << b) - 1), b)
            state[f"{name}.g_idx"] = g_idx
        state.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales})
    quantization = (
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
         "checkpoint_format": "gptq", "lm_head": lm_head})
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(saved, quantization_config=dict(quantization, **(config or {}))),
                                                   indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return expected
