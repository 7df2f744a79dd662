"""Pre-quantized Hugging Face folders (GPTQ, AWQ, compressed-tensors; `model/prequantized_config.py`)
served with their weights kept quantized, in the block layouts `--quantization int4 / int8` uses
(`model/weight_only.py`), so the same GGUF block kernels multiply them.

Each projection's packed tensors are read to w = s * v (`model/prequantized_codes.py`: v = code - zero
point, s its group's stored scale) and laid out in the first layout that holds every weight exactly:
- Q4_1 (4.5 + 0.5 bits a weight: a half scale d and a half minimum m per 32 inputs, w = d * q + m):
  d = s, q = v + c, m = -c * s for a shift c per block that keeps q in 0..15 and makes c * s a half
  (symmetric 4-bit: c = 8, m = -8 s, always; asymmetric: often none, since z * s needs up to 15 bits);
- Q8_0 (8.5 bits: a half scale per 32 inputs, w = d * q): d = s, q = v, when v fits an int8 (every
  4-bit code; 8-bit codes when symmetric);
- else float32, dequantized once at load: act-order groups (`g_idx` not in input order: a block of 32
  inputs spans several scales), groups not a multiple of 32, scales that are not halves (bf16 or float32
  beyond a half's precision), 8-bit asymmetric codes. Each is counted in the start-up line.
Both block layouts need the scale itself as a half: a half scale times an integer of at most 9 bits is
exact in float32, so the dequantized weight is the stored arithmetic's exact value (the method's own
fp16 dequantization rounds it once more, to a half). The embedding and the norms are the checkpoint's
float tensors; so is the LM head unless the folder packs it (GPTQModel's `lm_head: true`, an untied head
only), then held as a projection is. GPTQ's `dynamic` rules give a module its own bits, groups, sym and
desc_act, or leave it float (`Scheme.for_module`).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedrl.model.checkpoint import CheckpointError, load_weights, read_folder_config, read_state_dict
from pagedrl.model.decoder import CausalLM
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.moe import has_sparse_layers
from pagedrl.model.prequantized_codes import (
    Codes,
    PackingError,
    awq_codes,
    compressed_tensors_codes,
    gptq_codes,
)
from pagedrl.model.prequantized_config import Scheme, read_scheme
from pagedrl.model.weight_only import GROUP, Q4_1, Q8_0

# Shifts c to try for a Q4_1 block, those whose product with a scale is most often a half first
SHIFTS = sorted(range(-15, 17), key=lambda c: (-(c & -c).bit_length() if c else -99, abs(c)))
PACKED_LEAVES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
                 "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                        "weight_g_idx")}


def _halves(x: torch.Tensor) -> np.ndarray | None:
    """x (float64) as halves when every value is one exactly (finite), else None."""
    half = x.numpy().astype(np.float16)
    return half if bool(np.isfinite(half).all()) and np.array_equal(half.astype(np.float64), x.numpy()) else None


def q4_1_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """v [n, k] and the scale of each block of 32 [n, k/32] as exact Q4_1 blocks, or None where a block
    has no shift c (see the module docstring)."""
    n, k = values.shape
    blocks = values.view(n, k // GROUP, GROUP)
    low, high = -blocks.amin(dim=2), 15 - blocks.amax(dim=2)
    shift = torch.full(low.shape, 99, dtype=torch.int32)
    for c in SHIFTS:
        minimum = -c * scales
        exact = torch.from_numpy(minimum.numpy().astype(np.float16).astype(np.float64)) == minimum
        shift[(shift == 99) & (low <= c) & (c <= high) & exact] = c
    d = _halves(scales)
    if d is None or bool((shift == 99).any()):
        return None
    m = (-shift.double() * scales).numpy().astype(np.float16)
    q = (blocks + shift[..., None]).to(torch.uint8).numpy()
    out = np.empty((n, k // GROUP, 4 + GROUP // 2), dtype=np.uint8)
    out[:, :, 0:2] = d[..., None].view(np.uint8)
    out[:, :, 2:4] = m[..., None].view(np.uint8)
    out[:, :, 4:] = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return torch.from_numpy(out.reshape(n, -1))


def q8_0_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """v [n, k] and the scale of each block of 32 as exact Q8_0 blocks, or None (v beyond an int8, or a
    scale that is not a half)."""
    d = _halves(scales)
    if d is None or int(values.min()) < -128 or int(values.max()) > 127:
        return None
    n, k = values.shape
    out = np.empty((n, k // GROUP, 2 + GROUP), dtype=np.uint8)
    out[:, :, :2] = d[..., None].view(np.uint8)
    out[:, :, 2:] = values.to(torch.int8).numpy().reshape(n, k // GROUP, GROUP).view(np.uint8)
    return torch.from_numpy(out.reshape(n, -1))


Q8_0_OF_4BIT = "Q8_0 (4-bit codes: zero point x scale not a half, which Q4_1's minimum must be)"


def hold(codes: Codes, bias: torch.Tensor | None) -> tuple[nn.Module | torch.Tensor, str]:
    """The projection as exact Q4_1 or Q8_0 blocks (a GGUFLinear), else its float32 weight, with the
    start-up line's name for what was chosen and why (4-bit codes held in Q8_0 say so)."""
    values = codes.values
    n, k = values.shape
    group = codes.contiguous_group
    if group is None:
        return codes.dequantized().float(), "float32 (dequantized at load: act-order groups)"
    if group % GROUP:
        return codes.dequantized().float(), f"float32 (dequantized at load: groups of {group})"
    per_block = codes.scales.repeat_interleave(group // GROUP, dim=1)
    bias = None if bias is None else bias.float()
    if (blocks := q4_1_blocks(values, per_block)) is not None:
        return GGUFLinear(blocks, Q4_1, k, bias), "Q4_1"
    if (blocks := q8_0_blocks(values, per_block)) is not None:
        return GGUFLinear(blocks, Q8_0, k, bias), Q8_0_OF_4BIT if codes.bits == 4 else "Q8_0"
    why = "scales not halves" if _halves(codes.scales) is None else "codes beyond an int8"
    return codes.dequantized().float(), f"float32 (dequantized at load: {why})"


def _codes(scheme: Scheme, tensors: dict[str, torch.Tensor], name: str, k: int, n: int) -> Codes:
    if scheme.method == "gptq":
        return gptq_codes(tensors, scheme, name, k, n)
    if scheme.method == "awq":
        return awq_codes(tensors, name, k, n)
    return compressed_tensors_codes(tensors, name, k, n)


def _is_packed(scheme: Scheme, tensors: dict[str, torch.Tensor]) -> bool:
    if scheme.method == "compressed-tensors":
        return "weight_scale" in tensors
    return "qweight" in tensors


def _module_scheme(scheme: Scheme, name: str, packed: bool, tied: bool, folder: Path) -> Scheme | None:
    """The module's own scheme where its tensors are packed (None: a float module), after gptq's `dynamic`
    rules and `lm_head` flag: a packed module a "-:" rule leaves float, or a packed head the config does
    not name (vLLM reads neither), is refused, and so is a packed head tied to the embedding (GPTQModel
    refuses to write one; vLLM skips lm_head.* on a tied model)."""
    own = scheme.for_module(name) if scheme.method == "gptq" else scheme
    source = folder / "config.json"
    if packed and own is None:
        rule = next(key for key, _ in scheme.dynamic if key.startswith("-:") and re.match(key[2:], name))
        raise CheckpointError(f"{source}: quantization_config.dynamic[{rule!r}] leaves {name} unquantized, but the "
                              f"checkpoint holds it packed ({name}.qweight)")
    if packed and name == "lm_head" and tied:
        raise CheckpointError(f"{source}: tie_word_embeddings is true but lm_head is packed: a quantized head tied to "
                              "the embedding is not supported (GPTQModel quantizes only an untied head)")
    if packed and name == "lm_head" and scheme.method == "gptq" and not scheme.lm_head:
        raise CheckpointError(f"{source}: lm_head is packed but quantization_config.lm_head is not true")
    return own if packed else None


def load_prequantized(folder: Path) -> tuple[CausalLM, Scheme, Counter[str]]:
    """The float32 CPU model of a pre-quantized folder with its projections kept in blocks where exact,
    the scheme it read, and how many projections each layout holds."""
    scheme = read_scheme(folder)
    cfg = read_folder_config(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if has_sparse_layers(model):
        raise CheckpointError(f"{folder}: a pre-quantized mixture of experts ({cfg.model_type}) is not supported: its "
                              "experts are stacked tensors, not the projections these layouts hold")
    origins: dict[str, str] = {}
    state = read_state_dict(folder, dtype=torch.float32, origins=origins)
    kept: Counter[str] = Counter()
    for name, module in list(model.named_modules()):
        prefix = f"{name}."
        tensors = {key[len(prefix):]: state[key] for key in list(state) if key.startswith(prefix)
                   and "." not in key[len(prefix):]}
        if not isinstance(module, nn.Linear):
            continue
        own = _module_scheme(scheme, name, _is_packed(scheme, tensors), cfg.tie_word_embeddings, folder)
        if own is None:
            continue
        for leaf in (*PACKED_LEAVES[scheme.method], "weight"):
            state.pop(prefix + leaf, None)
        try:
            codes = _codes(own, tensors, name, module.in_features, module.out_features)
        except PackingError as e:
            raise CheckpointError(f"{origins.get(prefix + 'weight_scale', origins.get(prefix + 'qweight'))}: {e}") from None
        held, label = hold(codes, tensors.get("bias"))
        kept[label] += 1
        if isinstance(held, torch.Tensor):
            state[prefix + "weight"] = held
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, held)
        state.update({prefix + key: value for key, value in held.state_dict().items()})
    if not kept:
        raise CheckpointError(f"{folder}: config.json names quant_method {scheme.method!r} but no tensor is packed "
                              f"as {scheme.method} writes its weights")
    load_weights(model, state, str(folder), origins, assign=True)
    model.model.reset_rope()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), scheme, kept


def describe(scheme: Scheme, kept: Counter[str], device: torch.device) -> str:
    """The start-up line: the method, and how many projections each layout holds."""
    kinds = ", ".join(f"{name} x {n}" for name, n in sorted(kept.items()))
    how = ("multiplied by the GGUF block kernels in float32" if device.type == "cpu"
           else "dequantized per product in the model's dtype")
    return (f"{scheme.method} {scheme.bits}-bit weight-only, read from the checkpoint: {kinds}; Q4_1 / Q8_0 blocks "
            f"hold the stored arithmetic exactly, {how}")
