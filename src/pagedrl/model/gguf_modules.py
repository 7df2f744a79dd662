"""A projection, an embedding and a mixture of experts' experts whose weights stay GGUF blocks in memory.

Why: a decode step of a few sequences reads every weight once, so its speed is the speed the weights
stream from memory. The default model's GGUF stores its projections as Q4_1 (0.5625 bytes a weight)
and its embedding as Q8_0 (1.0625): kept so, the model holds about a sixth of its float32 bytes and
a step streams a seventh as many.

The numbers are the dequantized float32 model's:
- an engine step's products (`routes.quantized_linear`, the float32 routes' `products.quantized_rows`)
  multiply the blocks in `csrc/gguf_linear.cpp`, whose every output is the bits `float_linear` gives on
  the dequantized weight: a float32 engine's own bits for decode steps of a few rows (up to
  `MAX_ROWS_FLOAT`), and for larger steps a float32 sum in lanes where the float32 engine's `float_gemm`
  or MKL sums in its own order (they differ by rounding; a float32 engine with every step on
  `float_linear` gives the same bits);
- any other product (outside an engine step, on a device without the kernels) dequantizes the weight,
  whose values are `gguf.quants.dequantize`'s bits, and runs torch's own product on it, as the float32
  model would.
(tests/test_gguf_engine.py)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.kernels import ops
from pagedrl.kernels.products import INT8_TYPES, int8_rows, quantized_rows
from pagedrl.model import gguf_dequant, routed
from pagedrl.model.gguf_rows8 import ROWS8, ROWS8_TYPES, pack_rows8, unpack_rows8
from pagedrl.model.moe import Experts
from pagedrl.model.quantized_linear import QuantizedLinear

# The GGML types kept quantized: what llama.cpp's users download most (GGMLQuantizationType values; their
# block shapes are `gguf_dequant.FORMATS`', which the CPU kernels share).
SUPPORTED_TYPES = {t: gguf_dequant.FORMATS[t].name for t in (8, 2, 3, 6, 7, 12, 13, 14, 39)}
type_name = gguf_dequant.type_name
def dequantize(blocks: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of GGUF blocks [N, row_bytes] uint8 → [N, k] of `dtype`, `gguf.quants.dequantize`'s float32
    values (then rounded to `dtype`): on a CPU by the kernels' `gguf_dequantize`, elsewhere (CUDA, a CPU
    without the kernels) by the same arithmetic in torch (`model/gguf_dequant.py`)."""
    if blocks.device.type == "cpu" and ops.available():
        values = ops.gguf_dequantize(blocks, ggml_type, k)
        return values if dtype == torch.float32 else values.to(dtype)
    return gguf_dequant.dequantize(blocks, ggml_type, k, out_dtype=dtype)


class GGUFLinear(QuantizedLinear):
    """`nn.Linear(k, n)` whose weight is the GGUF blocks `qweight` [n, row_bytes] (uint8, a buffer: no
    gradient flows into it), with an optional float bias. A `QuantizedLinear`: outside an engine step
    (a trainer's frozen QLoRA base, `model/qlora_gguf.py`) its product is `DequantizedProduct`'s, which
    keeps no float copy of the weight for backward."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        if ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGML type {ggml_type} is not kept quantized; supported: {', '.join(SUPPORTED_TYPES.values())}")
        fmt = gguf_dequant.FORMATS[ggml_type]
        values, size = fmt.values, fmt.nbytes
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % values \
                or blocks.shape[1] != in_features // values * size:
            raise ValueError(f"{type_name(ggml_type)} blocks of {in_features} inputs must be uint8 [rows, "
                             f"{in_features // values * size}], got {blocks.dtype} {list(blocks.shape)}")
        super().__init__(in_features, blocks.shape[0], bias, None)
        self.register_buffer("qweight", blocks)
        self.ggml_type = ggml_type
        # An engine's products on 8-bit activations (`use_int8_activations`): llama.cpp's arithmetic;
        # `qweight` then perhaps in the `rows8` layout
        self.int8_activations = False
        self.rows8 = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={type_name(self.ggml_type)}, bias={self.bias is not None}"
                + (", activations=int8" if self.int8_activations else "") + (", layout=rows8" if self.rows8 else ""))

    @property
    def storage(self) -> str:
        return f"the GGUF file's own {type_name(self.ggml_type)} blocks"

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take: the GGML type, plus ROWS8 in that layout."""
        return int(self.ggml_type) + (ROWS8 if self.rows8 else 0)

    @property
    def blocks(self) -> torch.Tensor:
        """The blocks in the file's layout (`qweight` itself, or unpacked from `rows8`)."""
        return unpack_rows8(self.qweight, self.ggml_type) if self.rows8 else self.qweight

    def to_rows8(self) -> None:
        """Keep the blocks in the `rows8` layout (a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K weight of a
        multiple of 8 rows)."""
        if self.ggml_type not in ROWS8_TYPES or self.out_features % 8:
            raise ValueError("the rows8 layout holds Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K weights of a multiple of "
                             f"8 rows, not {type_name(self.ggml_type)} [{self.out_features}, {self.in_features}]")
        if not self.rows8:
            self.qweight = pack_rows8(self.qweight, self.ggml_type)
            self.rows8 = True

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [n, k] as `dtype` (a fresh tensor: nothing keeps it)."""
        return dequantize(self.blocks, self.ggml_type, self.in_features, dtype)

    def dequantized_into(self, out: torch.Tensor) -> torch.Tensor:
        if self.rows8 or self.qweight.device.type != "cpu" or not ops.available():
            return out.copy_(self.dequantized())
        ops.gguf_dequantize_into(self.qweight, self.ggml_type, self.in_features, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = routed.current()
        # (a QLoRA base's `bnb_4bit_compute_dtype` other than the step's: the product the trainer computes)
        if routes is not None and routes.quantized_linear is not None and self.compute_dtype in (None, x.dtype):
            route = int8_rows if self.int8_activations else routes.quantized_linear
            out = route(x, self.qweight, self.kernel_type, self.in_features, self.bias)
            if out is not None:
                return out
        return super().forward(x)

    def rows_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product a float32 engine step computes (its routes' choice: `products.quantized_rows`),
        for callers outside the routed scope: the decode program and the vocabulary projection."""
        route = int8_rows if self.int8_activations else quantized_rows
        out = route(x, self.qweight, self.kernel_type, self.in_features, self.bias)
        return out if out is not None else F.linear(x, self.dequantized(), self.bias)


def use_int8_activations(model: nn.Module) -> dict[str, int]:
    """Turn the engine's products of `model`'s Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K projections to 8-bit activations
    (`products.int8_rows`: llama.cpp's arithmetic, faster on a CPU, no longer the float32 model's numbers);
    the projections turned, counted by type. Others (Q2_K, Q3_K, MXFP4 experts) keep float32 activations.
    Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K weights of a multiple of 8 rows move to the `rows8` layout (a
    decode step's products faster), except a table an embedding looks rows up in (a tied LM head's)."""
    turned: dict[str, int] = {}
    tables = {id(m.table) for m in model.modules() if isinstance(m, GGUFEmbedding)}  # lookups, not products
    looked_up = {m.table.qweight.data_ptr() for m in model.modules() if isinstance(m, GGUFEmbedding)}
    for module in model.modules():
        if isinstance(module, GGUFLinear) and module.ggml_type in INT8_TYPES and id(module) not in tables:
            module.int8_activations = True
            if module.ggml_type in ROWS8_TYPES and module.out_features % 8 == 0 \
                    and module.qweight.data_ptr() not in looked_up:
                module.to_rows8()
            name = type_name(module.ggml_type)
            turned[name] = turned.get(name, 0) + 1
    return turned


class GGUFEmbedding(nn.Module):
    """`nn.Embedding(vocab, dim)` whose table is GGUF blocks [vocab, row_bytes]: a lookup dequantizes the
    rows it reads. A tied LM head is a `GGUFLinear` over the same buffer."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = GGUFLinear(blocks, ggml_type, embedding_dim)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype = dtype  # of the rows it returns: the model's; `.to(dtype)` moves it as it moves floats

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={type_name(self.table.ggml_type)}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = dequantize(self.table.qweight.index_select(0, flat), self.table.ggml_type, self.embedding_dim,
                          self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


class GGUFExperts(Experts):
    """A mixture of experts' E SwiGLU experts (Mixtral's, Qwen3-MoE's) as the GGUF file holds them: per
    expert a gate, an up and a down projection of blocks, each a `GGUFLinear`. An expert's rows take
    the float model's steps in its order: gate and up side by side as `gate_up_proj`'s product lays them,
    SiLU of the first half times the second, then down; so the float32 model's bits, as for every
    `GGUFLinear`. Not routable: the engine's expert route multiplies stacked float weights."""

    routable = False

    def __init__(self, gate: list[GGUFLinear], up: list[GGUFLinear], down: list[GGUFLinear]) -> None:
        nn.Module.__init__(self)  # (no stacked float tensors)
        if not len(gate) == len(up) == len(down) or not gate:
            raise ValueError(f"experts need as many gate, up and down projections, got {len(gate)}, {len(up)}, "
                             f"{len(down)}")
        self.num_experts, self.intermediate_size = len(gate), gate[0].out_features
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)

    def extra_repr(self) -> str:
        types = {type_name(m.ggml_type) for m in [*self.gate, *self.up, *self.down]}
        return f"experts={self.num_experts}, intermediate={self.intermediate_size}, types={sorted(types)}"

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = torch.cat([self.gate[e](rows), self.up[e](rows)], dim=-1).chunk(2, dim=-1)
        return self.down[e](F.silu(gate) * up)
