"""A QLoRA base read from a GGUF file: each decoder projection the file already holds in at most the bits
asked for keeps the file's own blocks; the others are quantized as bitsandbytes would (NF4 blocks, int8
rows). `load_in_4bit` keeps Q4_0, Q4_1 and Q4_K; `load_in_8bit` those, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0.

Why: a GGUF's float model is its blocks dequantized, so quantizing that model to NF4 rounds every weight
a second time, onto a grid that does not hold the first rounding's values. The default model (Q4_1) lost
most of its arithmetic so (perplexity 12.26 -> 33.0, `bench/RESULTS.md`). Its own blocks dequantize to
the float model's weights bit for bit: a QLoRA run on them computes what LoRA on the float model
computes, holding the projections in a sixth of the bytes, and the engine's rollouts multiply them with
its GGUF kernels (`model/gguf_modules.py`). A `bnb_4bit_quant_type` set explicitly quantizes every
projection to it, as asked.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from pagedrl.model.gguf_dequant import FORMATS
from pagedrl.model.gguf_modules import GGUFEmbedding, GGUFLinear
from pagedrl.model.gguf_quantized import projection_blocks
from pagedrl.model.moe import has_sparse_layers
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.quantized_linear import QuantizedBase, quantize_projections
from pagedrl.model.resolve import resolve_gguf


def nominal_bits(ggml_type: int) -> int:
    """The bits a GGML type gives each weight before its block scales: 4 for Q4_1 and MXFP4, 6 for Q6_K."""
    return int(re.search(r"\d+", FORMATS[ggml_type].name)[0])


def quantize_base(model: nn.Module, spec: QuantizedBase, source: str | Path | None,
                  revision: str | None = None) -> list[str]:
    """`quantize_projections` for a base loaded from `source` (a model argument: the default model's name,
    a `.gguf` file, a folder or a Hub id): where `source` is a GGUF file and `spec` keeps file blocks, its
    projections of at most `spec.bits` bits are the file's blocks. Returns the projections' names."""
    kept = {}
    found = resolve_gguf(source, revision) if spec.keeps_file_blocks and not has_sparse_layers(model) else None
    if found is not None:  # (a mixture of experts is refused by `quantize_projections`)
        kept = projection_blocks(*found, keep=lambda ggml_type: nominal_bits(ggml_type) <= spec.bits)
    return quantize_projections(model, spec, kept)


def as_qlora_base(model: nn.Module, spec: QuantizedBase) -> None:
    """A model loaded with its GGUF blocks kept (`quantization="gguf"`) made, in place, the base a QLoRA run
    trains on: the embedding and the LM head float32 as on a float base (the trainer's logits read the
    head's float weight), each projection of more than `spec.bits` bits quantized by `spec` from its
    dequantized values, every other projection kept. What a float load followed by `quantize_base` gives,
    without ever holding the kept projections in float32: their 4 bytes a weight never enter the process's
    heap, which keeps (and reuses only in part) what it frees (`kernels/memory.py`)."""
    if has_sparse_layers(model):
        quantize_projections(model, spec)  # (refused there, in its words)
    embed = model.model.embed_tokens
    if isinstance(embed, GGUFEmbedding):
        table = embed.table
        weight = nn.Parameter(table.dequantized(), requires_grad=False)
        model.model.embed_tokens = _with_weight(nn.Embedding(embed.num_embeddings, embed.embedding_dim, device="meta"), weight)
        if isinstance(model.lm_head, GGUFLinear) and model.lm_head.qweight is table.qweight:  # tied
            model.lm_head = _with_weight(nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta"), weight)
    if isinstance(model.lm_head, GGUFLinear):
        model.lm_head = _float_linear(model.lm_head)
    for name, module in list(model.named_modules()):
        if isinstance(module, GGUFLinear) and name.rpartition(".")[2] in LAYER_PROJECTIONS:
            parent, _, child = name.rpartition(".")
            if nominal_bits(module.ggml_type) > spec.bits:
                setattr(model.get_submodule(parent), child, spec.layer(_float_linear(module)))
            else:
                module.compute_dtype = spec.compute_dtype


def _with_weight(module: nn.Module, weight: nn.Parameter) -> nn.Module:
    """`module` (made on the meta device: nothing allocated) holding `weight`."""
    module.weight = weight
    return module


def _float_linear(layer: GGUFLinear) -> nn.Linear:
    """The float32 Linear of a kept layer's dequantized weight (and its bias)."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = nn.Parameter(layer.dequantized(), requires_grad=False)
    linear.bias = layer.bias
    return linear
