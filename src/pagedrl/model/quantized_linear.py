"""Frozen projections held in QLoRA's 4-bit or LLM.int8's 8-bit storage (`model/bnb_quant.py`): the
base of a `load_in_4bit` / `load_in_8bit` LoRA run.

Why a Function of its own: `F.linear(x, dequantized_weight)` under autograd saves the dequantized
weight for backward, so every projection of a forward would hold a float copy of its weight until
backward, as much memory as the float model the quantization saved. `DequantizedProduct` saves
nothing: backward dequantizes the weight again for grad_input = grad · W, and the weight gets no
gradient (it is a buffer). The adapters beside it (`model/lora.py`) train in float32 as usual.

The compute dtype: `compute_dtype` when set (bitsandbytes' `bnb_4bit_compute_dtype`), else autocast's
dtype inside autocast (a bf16 run: the dequantized weight rounded to bf16, as autocast rounds a float
weight), else the input's. The engine samples a LoRA policy's rollouts on these same modules: no
float copy, no merge.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model import batch_invariant, bnb_quant
from pagedrl.model.moe import has_sparse_layers
from pagedrl.model.projections import LAYER_PROJECTIONS


@contextlib.contextmanager
def _autocast_off(device_type: str) -> Iterator[None]:
    """Autocast off for a product already in its dtype. Not `torch.autocast(enabled=False)`: leaving
    that block can clear autocast's cast cache, which a checkpointed adapter (dropout) relies on."""
    was = torch.is_autocast_enabled(device_type)
    torch.set_autocast_enabled(device_type, False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, was)


_scratch = threading.local()


def _buffer(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable buffer of `shape` and `dtype` (one per kind of projection), one made in
    inference mode (an engine step's) and one outside it (a trainer's): torch refuses to write an
    inference tensor outside inference mode."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (shape, dtype, device, torch.is_inference_mode_enabled())
    if key not in buffers:  # never packed by a batch-invariant product (it holds every layer of its shape in turn)
        buffers[key] = batch_invariant.scratch(torch.empty(shape, dtype=dtype, device=device))
    return buffers[key]


def product_weight(layer: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    """The weight a product multiplies by, dequantized. On a CPU into this thread's buffer of its shape,
    which the next product of that shape overwrites: a trainer dequantizes every projection twice a
    step, and a fresh block each time (3.5 MB for one of the default model's MLP weights) left holes in
    the heap that the process keeps (`kernels/memory.py`) and the step's larger activations cannot reuse:
    the QLoRA base's GRPO step then peaked no lower than a float base's. Safe because a product's weight
    is used within the call and never saved (`DequantizedProduct`)."""
    if layer.device.type != "cpu":
        return layer.dequantized(dtype)
    shape = (layer.out_features, layer.in_features)
    weight = layer.dequantized_into(_buffer(shape, torch.float32, layer.device))
    return weight if dtype == torch.float32 else _buffer(shape, dtype, layer.device).copy_(weight)


class DequantizedProduct(torch.autograd.Function):
    """x Wᵀ + b with W dequantized in forward and again in backward, never saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        with _autocast_off(x.device.type):
            return F.linear(x, product_weight(layer, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None
        with _autocast_off(grad.device.type):
            return grad @ product_weight(ctx.layer, grad.dtype), None, None


class QuantizedLinear(nn.Module):
    """A frozen `nn.Linear(k, n)` whose weight lives in buffers; subclasses say how it dequantizes."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = compute_dtype

    storage = ""  # how the weight is held, for the start-up summary

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [n, k] as `dtype` (a fresh tensor: nothing keeps it)."""
        raise NotImplementedError

    def dequantized_into(self, out: torch.Tensor) -> torch.Tensor:
        """The weight written into `out` (float32 [n, k]); formats that can, without a fresh tensor."""
        return out.copy_(self.dequantized(torch.float32))

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.storage}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = self.compute_dtype or (torch.get_autocast_dtype(x.device.type) if autocast else x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        out = DequantizedProduct.apply(x.to(dtype), self, bias)
        return out if autocast else out.to(x.dtype)


class Linear4bit(QuantizedLinear):
    """NF4 or FP4 blocks of 64 (`qweight` packed codes, `absmax` block maxima; `nested_*` under double
    quantization), bitsandbytes' `Linear4bit` layout."""

    def __init__(self, linear: nn.Linear, quant_type: str = "nf4", nested: bool = False,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias, compute_dtype)
        q = bnb_quant.quantize_4bit(linear.weight, quant_type, nested)
        self.quant_type = quant_type
        self.register_buffer("qweight", q.packed)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("nested_absmax", q.nested_absmax)
        self.register_buffer("nested_offset", q.nested_offset)

    def quantized(self) -> bnb_quant.Quantized4bit:
        return bnb_quant.Quantized4bit(self.qweight, self.absmax, (self.out_features, self.in_features),
                                       self.quant_type, self.nested_absmax, self.nested_offset)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return bnb_quant.dequantize_4bit(self.quantized(), dtype)

    def dequantized_into(self, out: torch.Tensor) -> torch.Tensor:
        return bnb_quant.dequantize_4bit(self.quantized(), out=out)

    @property
    def storage(self) -> str:
        nested = ", double quantization" if self.nested_absmax is not None else ""
        return f"{self.quant_type} blocks of {bnb_quant.BLOCK_4BIT}{nested}"


class Linear8bit(QuantizedLinear):
    """LLM.int8's weight storage: `qweight` int8 [n, k] and `scale` the row absmax [n]."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias, compute_dtype)
        q, scale = bnb_quant.quantize_int8_rows(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return bnb_quant.dequantize_int8_rows(self.qweight, self.scale, dtype)

    storage = "int8 rows (LLM.int8 storage, no outlier decomposition)"


@dataclass(frozen=True)
class QuantizedBase:
    """How a frozen base is held: 4 or 8 bits, and the 4-bit options. `quant_type` None: NF4 (int8 rows
    at 8 bits), except where the base is a GGUF file already holding a projection in at most `bits` bits,
    which keeps the file's own blocks (`model/qlora_gguf.py`); set, every projection is quantized (to it,
    or to int8 rows at 8 bits)."""

    bits: int
    quant_type: str | None = None
    nested: bool = False
    compute_dtype: torch.dtype | None = None

    @property
    def field(self) -> str:
        return f"load_in_{self.bits}bit"

    @property
    def keeps_file_blocks(self) -> bool:
        return self.quant_type is None

    def layer(self, linear: nn.Linear) -> QuantizedLinear:
        if self.bits == 8:
            return Linear8bit(linear, self.compute_dtype)
        return Linear4bit(linear, self.quant_type or "nf4", self.nested, self.compute_dtype)


def quantize_projections(model: nn.Module, spec: QuantizedBase, kept: Mapping[str, QuantizedLinear] | None = None) -> list[str]:
    """Replace every decoder-layer projection of `model` (in place, one at a time, each float weight
    released as it goes) by its quantized layer, or by `kept[key]` where given (a GGUF file's own
    blocks of the same weight; `key` the name from `layers.` on, so that a causal LM's and a scorer's
    backbone find the same entries); returns their names. Embeddings, norms and heads stay float, as
    transformers leaves the output head unquantized. Refused for a projection that is not a plain
    Linear (a GGUF kept quantized) and for a mixture of experts (its experts are stacked tensors)."""
    if has_sparse_layers(model):
        raise ValueError(f"{spec.field}: a mixture of experts' base cannot be held quantized (its experts are "
                         "stacked tensors, not Linear layers); train it with use_peft alone")
    names = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in LAYER_PROJECTIONS]
    odd = [f"{n} ({type(model.get_submodule(n)).__name__})" for n in names
           if not isinstance(model.get_submodule(n), nn.Linear)]
    if odd or not names:
        raise ValueError(f"{spec.field}: needs a model whose projections are plain Linear layers of float weights; "
                         f"got {odd[0] if odd else 'none'} (load the float checkpoint, not a GGUF kept quantized)")
    kept = kept or {}
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, child)
        key = name[name.find("layers."):]
        if key in kept:
            layer = kept[key].to(linear.weight.device)
            if (layer.in_features, layer.out_features) != (linear.in_features, linear.out_features):
                raise ValueError(f"{spec.field}: {name} is [{linear.out_features}, {linear.in_features}] in the model "
                                 f"but [{layer.out_features}, {layer.in_features}] in its GGUF file")
            layer.bias = linear.bias if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
            layer.compute_dtype = spec.compute_dtype
        else:
            layer = spec.layer(linear)
        setattr(owner, child, layer)
    return names


def quantized_layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def dequantize_projections(model: nn.Module) -> None:
    """Replace every quantized projection of `model` (in place) by a float32 Linear holding its
    dequantized weight: a merged QLoRA model's untargeted projections, as the adapter was trained on."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear) and name.rpartition(".")[2] in LAYER_PROJECTIONS:
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            linear.weight = nn.Parameter(m.dequantized(torch.float32), requires_grad=False)
            linear.bias = m.bias
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
