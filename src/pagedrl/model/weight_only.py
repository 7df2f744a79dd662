"""int8 and int4 weight-only quantization made at load (`quantization="int8"` / `"int4"`), for any model that
is not quantized already: a Hugging Face folder, the default model, a GGUF dequantized at load.

vLLM's nearest method is its load-time round-to-nearest quantization; the choices here are spelled `int8`
and `int4`. The rules (every step in float64, one rounding to half precision for each stored scale):
- int8, symmetric, one scale per output channel: s = fp16(max|w_row| / 127), q = clamp(rint(w / s), -127, 127)
  (rint: to nearest, ties to even; a row whose s is 0, all zeros or too small for a half, gets q = 0);
  the weight is s * q.
- int4, asymmetric, groups of 32 inputs with a scale and a minimum each (the affine form torchao's int4
  weight-only uses, at group size 32): m = fp16(min g), d = fp16((max g - m) / 15),
  q = clamp(rint((w - m) / d), 0, 15) (d = 0: q = 0); the weight is d * q + m, rounded once to float32.
  With int4 the embedding and the LM head are int8 (per output channel, per vocabulary row), as the
  default model's own GGUF keeps them at 8 bits: the vocabulary projection is where 4 bits cost most.
Weights beyond a half's range (a scale or minimum above 65504), or not finite, are refused.

Where they live: in the block layouts the GGUF kernels multiply (`kernels/csrc/gguf_linear.cpp`), so
the modules are `GGUFLinear` / `GGUFEmbedding` and every path of `quantization="gguf"` is theirs (the
float32 engine's routes, the decode program, the dequantizing fallback on CUDA). int4 is exactly Q4_1
(a half scale d, a half minimum m, 32 4-bit values); int8 per channel is Q8_0 (a half scale, 32 int8)
with the row's one scale repeated in each of its blocks: 1.0625 bytes a weight where a per-channel
tensor holds 1 + 4/k, for kernels that exist and were measured. Chosen by measurement, the default
model's 210 projections on one thread of an AVX512-BF16 CPU (no AMX; `bench/bench_weight_only.py`,
bench/RESULTS.md): torch's own `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` take float32
rows 12-70x slower than the GGUF kernels; on bf16 rows the int4 one is level with Q4_1 at one row and
the int8 one slower than Q8_0, and from 16 rows both lose to the bf16 engine's float kernel.

The numbers (tests/test_weight_only.py): the quantized model computes the float32 model whose weights
are the dequantized values above, as `quantization="gguf"` does its file's (`model/gguf_modules.py`):
the same logits outside the engine, and in the engine the same tokens and log-probs as that float32
model with every step's products on its float32 kernel.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedrl.model.decoder import CausalLM
from pagedrl.model.gguf_modules import GGUFEmbedding, GGUFLinear
from pagedrl.model.moe import has_sparse_layers

WEIGHT_ONLY = ("int8", "int4")  # the `quantization` choices made at load
GROUP = 32  # inputs a block covers: int4's group, and the block int8's per-channel scale is repeated in
Q8_0, Q4_1 = int(GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q4_1)
HALF_MAX = float(np.finfo(np.float16).max)
LAYER_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class QuantizationError(ValueError):
    """A weight the rule cannot hold: named, with why."""


def _float64(w: torch.Tensor, name: str, method: str) -> torch.Tensor:
    """w [n, k] as a float64 copy the rule may work on in place, its inputs checked against the groups."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise QuantizationError(f"quantization={method!r}: {name} has {w.shape[-1]} inputs, which groups of {GROUP} "
                                "do not divide")
    return w.detach().to("cpu", torch.float64, copy=True)


def _half(x: torch.Tensor, name: str, method: str, what: str) -> np.ndarray:
    """x (float64) rounded once to half precision (numpy's float64 -> float16 is correctly rounded, where
    torch's goes through float32), refused beyond a half's range. x is a row's or a group's extreme, so
    an inf or NaN among the weights shows here (max and min propagate NaN)."""
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"quantization={method!r}: {name} holds inf or NaN")
    biggest = float(x.abs().max()) if x.numel() else 0.0
    if biggest > HALF_MAX:
        raise QuantizationError(f"quantization={method!r}: {name}'s {what} {biggest:.4g} is beyond a half's "
                                f"range ({HALF_MAX:.0f})")
    return x.numpy().astype(np.float16)


def _wide(half: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(half.astype(np.float64))


def int8_rule(w: torch.Tensor, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """(q [n, k] int8, s [n] float16): the int8 rule (module docstring) on w [n, k]."""
    values = _float64(w, name, "int8")
    s = _half(values.abs().amax(dim=1) / 127.0, name, "int8", "scale")
    s64 = _wide(s)[:, None]
    q = values.div_(s64.where(s64 != 0, 1.0)).round_().clamp_(-127, 127).masked_fill_(s64 == 0, 0.0)
    return q.to(torch.int8).numpy(), s


def int4_rule(w: torch.Tensor, name: str = "weight") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [n, k] uint8 in 0..15, d [n, k/32] float16, m [n, k/32] float16): the int4 rule on w [n, k]."""
    values = _float64(w, name, "int4")
    n, k = values.shape
    groups = values.view(n, k // GROUP, GROUP)
    m = _half(groups.amin(dim=2), name, "int4", "group minimum")
    m64 = _wide(m)
    d = _half((groups.amax(dim=2) - m64) / 15.0, name, "int4", "group scale")
    d64, m64 = _wide(d)[..., None], m64[..., None]
    q = groups.sub_(m64).div_(d64.where(d64 != 0, 1.0)).round_().clamp_(0, 15).masked_fill_(d64 == 0, 0.0)
    return q.reshape(n, k).to(torch.uint8).numpy(), d, m


def int8_blocks(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """w [n, k] under the int8 rule as Q8_0 blocks [n, k/32 * 34] uint8, the row's scale in each block."""
    q, s = int8_rule(w, name)
    n, k = q.shape
    blocks = np.empty((n, k // GROUP, 2 + GROUP), dtype=np.uint8)
    blocks[:, :, :2] = np.repeat(s[:, None], k // GROUP, axis=1)[..., None].view(np.uint8)
    blocks[:, :, 2:] = q.reshape(n, k // GROUP, GROUP).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def int4_blocks(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """w [n, k] under the int4 rule as Q4_1 blocks [n, k/32 * 20] uint8: d, m, then byte j holding value j
    in its low nibble and value j + 16 in its high one (gguf's layout)."""
    q, d, m = int4_rule(w, name)
    n, k = q.shape
    groups = q.reshape(n, k // GROUP, GROUP)
    blocks = np.empty((n, k // GROUP, 4 + GROUP // 2), dtype=np.uint8)
    blocks[:, :, 0:2] = d[..., None].view(np.uint8)
    blocks[:, :, 2:4] = m[..., None].view(np.uint8)
    blocks[:, :, 4:] = groups[..., :GROUP // 2] | (groups[..., GROUP // 2:] << 4)
    return torch.from_numpy(blocks.reshape(n, -1))


def quantize_weights(model: CausalLM, method: str) -> Counter[str]:
    """`model` (float, on the CPU) with its projections, embedding and LM head replaced in place by their
    `method` blocks; returns how many tensors each layout holds ("int8 per channel", "int4 group 32")."""
    if method not in WEIGHT_ONLY:
        raise ValueError(f"quantization={method!r}: not a weight-only method; expected {', '.join(WEIGHT_ONLY)}")
    if has_sparse_layers(model):
        raise QuantizationError(f"quantization={method!r} is not built for a mixture of experts' stacked expert "
                                f"weights ({model.config.model_type}); load it without quantization")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # elementwise passes over a few MB each: on a shared CPU, threads that wait for
    try:  # each other made the default model's quantization 10x slower (60 s against 6)
        return _quantize_weights(model, method)
    finally:
        torch.set_num_threads(threads)


def _quantize_weights(model: CausalLM, method: str) -> Counter[str]:
    kept: Counter[str] = Counter()

    def linear(module: nn.Module, name: str, int4: bool) -> GGUFLinear:
        if not isinstance(module, nn.Linear):
            raise QuantizationError(f"quantization={method!r}: {name} is a {type(module).__name__}, not a projection")
        weight, bias = module.weight.detach(), module.bias
        blocks = int4_blocks(weight, f"{name}.weight") if int4 else int8_blocks(weight, f"{name}.weight")
        kept["int4 group 32" if int4 else "int8 per channel"] += 1
        return GGUFLinear(blocks, Q4_1 if int4 else Q8_0, weight.shape[1],
                          None if bias is None else bias.detach().float().clone())

    for index, layer in enumerate(model.model.layers):
        for path in LAYER_PROJECTIONS:
            parent_name, _, child = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, child, linear(getattr(parent, child), f"model.layers.{index}.{path}", method == "int4"))
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight or model.config.tie_word_embeddings
    table = int8_blocks(embed.weight.detach(), "model.embed_tokens.weight")
    model.model.embed_tokens = GGUFEmbedding(table, Q8_0, embed.embedding_dim)
    kept["int8 per channel"] += 1
    if tied:
        model.lm_head = GGUFLinear(table, Q8_0, embed.embedding_dim)
    else:
        model.lm_head = linear(model.lm_head, "lm_head", False)
    return kept


def describe(method: str, kept: Counter[str], device: torch.device) -> str:
    """The start-up line's account of what was quantized and which kernel multiplies it."""
    kinds = ", ".join(f"{name} x {n}" for name, n in sorted(kept.items()))
    how = ("multiplied by the GGUF block kernels in float32" if device.type == "cpu"
           else "dequantized per product in the model's dtype")
    return f"{method} weight-only, made at load: {kinds} (in Q4_1 / Q8_0 block layouts, {how})"
