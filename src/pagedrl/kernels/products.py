"""The engine's own products for a CPU's bf16 projections, and the copies of the weights they read.

Products of `csrc/decode_linear.cpp` and `csrc/pair_linear.cpp`, and what they were measured against. A
decode step feeds one row per sequence, so each of the model's matmuls is a pass over its weights
with little arithmetic: the step's speed is how fast the weights stream through the cores. On this
project's CPU (AMX and AVX512-BF16), oneDNN's bf16 kernel runs the default model's 211 projections
(270 MB) at 30-35 ms a step for 1-16 rows (2 threads), half the memory bandwidth: its AMX kernel
wants the weights in its own blocked layout and reorders them on every call. The engine's kernels
read them as they lie:
- with AMX, the weights are the tile multiply's left operand, 16 rows x 32 columns straight from the
  tensor, and the step's rows the right one (packed per call, a few KB): 14-16 ms for 1-16 rows
  against oneDNN's 30, 27 against 38 at 64 rows, 46 against 51 at 128; oneDNN is ahead from about
  200 rows (`MAX_ROWS_AMX` = 128; `bench/bench_decode_linear.py`);
- without AMX (AVX512-BF16 only, e.g. AMD's Zen 4), the k-pairs kernel (`csrc/pair_linear.cpp`) on its
  own copy of each weight, laid out once as [N / 32][K / 2][32][2] so that a panel of 32 output
  features streams from first byte to last while up to 12 rows' sums stay in registers. 2 threads,
  `bench/bench_decode_linear.py`: 9.4 / 13.8 / 20.1 / 51.9 / 96.9 ms at 1 / 4 / 16 / 64 / 128 rows
  against oneDNN on its own packed copy's 21.5 / 23.1 / 31.4 / 60.7 / 104.4 (at one row the weights
  stream at 28 GB/s, the memory's speed) and on a 2048-row prefill chunk level with it. Its rows are
  batch-invariant (each output one float32 chain in k order). oneDNN's packed copies
  (`PackedWeights`, oneDNN's reorder; the same numbers as `F.linear`'s) stay for products that must
  equal a trainer's. Either copy costs the weights' size in memory again (270 MB for the default
  model).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch

from pagedrl.kernels import isa, ops

MAX_ROWS_AMX = 128  # measured crossovers with oneDNN's bf16 kernel (see above)
MAX_ROWS_DOT = 32  # no AMX here, and none in oneDNN's kernel either
MAX_ROWS_OVER_PACKED = 2  # where the dot-product kernel beats oneDNN on packed weights (no AMX)
PACK_FOR_ROWS = 64  # the row count oneDNN is told to expect when it chooses its layout
# float32 products up to MAX_ROWS_FLOAT rows on `csrc/float_linear.cpp` (dot products over the weights as
# they lie: a decode step's few rows), above that up to MAX_ROWS_GEMM on the outer-product tiles of
# `csrc/float_gemm.cpp` (panels of 16 rows, or 8 for a last panel at most half full), MKL's above, by CPU
# class. The default model's 211 projections, ms, float_linear / float_gemm, 1 and 2 threads, on AMD Zen 4
# (AVX512-BF16) and the same capped to AVX2: at 1 row 21.7 / 36.7, 15.5 / 24.0 (AVX512) and 22.4 / 34.5,
# 13.4 / 26.9 (AVX2); at 2 rows 36.5 / 36.6, 20.9 / 23.6 and 39.5 / 34.4, 22.1 / 22.7; at 3 rows 41.6 /
# 36.7, 22.7 / 23.7 and 44.3 / 34.4, 24.2 / 23.3; at 4 rows 45.9 / 36.7, 25.8 / 23.8 and 46.0 / 34.6,
# 25.0 / 23.0; at 12 rows 64.2 / 48.4, 35.7 / 28.3 and 59.7 / 45.8, 33.2 / 27.4. Against MKL, capped to
# AVX2, 1 / 2 threads: 2.1x / 2.6x at 16 rows, 1.4x / 1.5x at 64, 1.05x / 1.04x at a 2048-row chunk
# (`bench/bench_float_linear.py`). AMX (an Intel Xeon, where MKL is at home) keeps the 32 rows measured
# there and MKL above.
MAX_ROWS_FLOAT_BY_CLASS = {"avx2": 3, "avx512": 3, "avx512_bf16": 3, "amx": 32}
MAX_ROWS_GEMM_BY_CLASS = {"avx2": 2048, "avx512": 2048, "avx512_bf16": 2048, "amx": 0}
# GGUF products up to this many rows on the blocks as they are, above on them dequantized (then
# `float_linear`; the same bits). Q4_1, 2 threads, ms, blocks / dequantized: AVX512-BF16 46 / 35 at 33
# rows; capped to AVX2 34 / 65 at 24, 86 / 100 at 64, 300 / 410 at 256, 629 / 767 at 512.
MAX_ROWS_QUANTIZED_BY_CLASS = {"avx2": 256, "avx512": 16, "avx512_bf16": 16, "amx": 16}


# Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the GGML types `gguf_linear_int8` multiplies. It runs every row count: one thread, a
# 1536 x 576 weight, AVX512-VNNI, ms, 8-bit activations / the float32 route: Q8_0 0.040 / 0.066 at 1 row,
# 0.37 / 0.51 at 16, 1.44 / 2.47 at 64, 11.2 / 12.6 at 512 (dequantized, then `float_linear`); Q4_1 level
# with the float32 route from 256 rows (13.1 / 12.4 at 512).
# Q4_K, Q5_K, Q6_K (12, 13, 14) on llama.cpp's activation blocks of 256 (`csrc/gguf_int8_kquants.h`).
INT8_TYPES = (8, 2, 3, 6, 7, 12, 13, 14)


def _by_class(table: dict[str, int]) -> int:
    return table.get(isa.cpu_class(), min(table.values()))


MAX_ROWS_FLOAT = _by_class(MAX_ROWS_FLOAT_BY_CLASS)
MAX_ROWS_GEMM = _by_class(MAX_ROWS_GEMM_BY_CLASS)
MAX_ROWS_QUANTIZED = _by_class(MAX_ROWS_QUANTIZED_BY_CLASS)


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN can lay bf16 weights out in its blocked layout here: a torch built with oneDNN, on
    a CPU of class AVX512 or above (its reorder refuses bf16 without AVX512BW/VL/DQ)."""
    return (isa.at_least("avx512") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@functools.cache
def packs_weights() -> bool:
    """Whether bf16 products of more than MAX_ROWS_OVER_PACKED rows go to oneDNN with packed weights: a
    CPU with AVX512-BF16 and no AMX (where that was measured the faster from 3 rows to a 2048-row
    prefill chunk)."""
    return ops.decode_linear_available() and not ops.decode_linear_amx() and onednn_packs_bf16()


@functools.cache
def max_rows() -> int:
    """The most rows a product may have to go through the engine's kernel here (0: not built for this
    CPU); where `packs_weights()`, `PackedWeights` takes the products of any size above
    MAX_ROWS_OVER_PACKED."""
    if not ops.decode_linear_available():
        return 0
    return MAX_ROWS_AMX if ops.decode_linear_amx() else MAX_ROWS_DOT


def kernel(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] bf16 @ weight [N, K].T (+ bias) -> [M, N] bf16 (`csrc/decode_linear.cpp`)."""
    return ops.decode_linear(rows, weight, bias)


def _takes_of(dtype: torch.dtype) -> Callable[..., bool]:
    """The kernels' terms for tensors of `dtype`: CPU tensors, and no gradient recorded (they have no
    backward; the runner runs in inference mode). Asked some 300 times a decode step: a plain loop over
    `is` and `is_cpu` (0.6 us for two tensors, where a generator over `device.type` took 2.2)."""

    def takes(*tensors: torch.Tensor) -> bool:
        if torch.is_grad_enabled():
            return False
        for t in tensors:
            if t.dtype is not dtype or not t.is_cpu:
                return False
        return True

    return takes


takes = _takes_of(torch.bfloat16)  # the bf16 kernels'
takes_float32 = _takes_of(torch.float32)  # the row-wise kernels' float32 forms (a float32 engine's steps)


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A projection's product through the kernel when it has at most `max_rows()` rows."""
    if not takes(x, weight) or weight.stride(-1) != 1 or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > max_rows():
        return None
    return kernel(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def float_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 projection's product on the engine's kernels (`float_kernel`) when no gradient is
    recorded (they have no backward): `csrc/float_linear.cpp` up to `MAX_ROWS_FLOAT` rows, the weights
    read as they lie, at 1.1-2.3x MKL's speed for a few rows (`bench/bench_float_linear.py`), and
    `csrc/float_gemm.cpp` above, to a 2048-row prefill chunk."""
    if (torch.is_grad_enabled() or x.dtype is not _F32 or weight.dtype is not _F32 or not x.is_cpu or not weight.is_cpu
            or weight.stride(-1) != 1 or (bias is not None and bias.dtype is not _F32)):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > max(MAX_ROWS_FLOAT, MAX_ROWS_GEMM):
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return float_kernel(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def describe_float() -> str:
    """Which float32 kernel takes which products, for the start-up line."""
    line = f"products of up to {MAX_ROWS_FLOAT} rows on the float32 kernel ({ops.float_linear_lanes()} lanes)"
    if MAX_ROWS_GEMM > MAX_ROWS_FLOAT:
        line += f", up to {MAX_ROWS_GEMM} on its tiles"
    return line + ", MKL's above"


def float_kernel(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The engine's float32 kernel for `rows` [M, K] (unit stride) against `weight` [N, K]: `float_linear`
    up to `MAX_ROWS_FLOAT` rows, `float_gemm` up to `MAX_ROWS_GEMM`; None above (MKL's)."""
    if rows.shape[0] <= MAX_ROWS_FLOAT:
        return ops.float_linear(rows, weight, bias)
    if rows.shape[0] <= MAX_ROWS_GEMM:
        return ops.float_gemm(rows, weight, bias)
    return None


def float_experts(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor
                  ) -> torch.Tensor | None:
    """A float32 step's mixture-of-experts products (`Routes.experts`): each expert's products as
    `float_rows` takes them (the float32 kernels by row count, `float_kernel`; an expert sees a share of
    a decode step's rows, so mostly `float_linear`), the stacked weights read as they lie."""
    if (torch.is_grad_enabled() or rows.dtype is not _F32 or gate_up.dtype is not _F32 or down.dtype is not _F32
            or not rows.is_cpu or not gate_up.is_cpu):
        return None
    rows = _unit_stride_rows(rows)
    width = down.shape[-1]
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            part = rows[start:start + count]
            both = _float_product(part, gate_up[expert])
            hidden = torch.nn.functional.silu(both[:, :width]) * both[:, width:]
            outputs.append(_float_product(hidden, down[expert]))
            start += count
    return torch.cat(outputs)


def _float_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = float_rows(x, weight, None)
    return torch.nn.functional.linear(x, weight) if out is None else out


_F32 = torch.float32


def _block_rows(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x` as the block kernels' [M, k] rows of unit stride, or None where they do not take it (a gradient
    recorded, not float32 or not on the CPU)."""
    if (torch.is_grad_enabled() or x.dtype is not _F32 or not x.is_cpu or not blocks.is_cpu
            or (bias is not None and bias.dtype is not _F32)):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def quantized_rows(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """A GGUF weight's product (`csrc/gguf_linear.cpp`): float32 rows, any number of them, no gradient
    recorded. Every output is the bits `float_linear` gives on the dequantized weight (one float32 chain in
    k order), which is `float_rows`' product up to `MAX_ROWS_FLOAT` rows; above, where a float32 model goes
    to MKL, a float32 engine with every step on its kernel gives the same bits.
    Up to `MAX_ROWS_QUANTIZED` rows the blocks are multiplied as they are (dequantized in registers: the
    weights stream at their quantized size); above, the weight is dequantized (a few ms for a whole model)
    and `float_linear` runs on it, with the same bits. The default model's 210 Q4_1 projections, one
    thread, AVX512 (`bench/bench_gguf_linear.py`), at 1 / 8 / 16 / 64 / 256 / 1024 rows: the quantized kernel
    5.1 / 19.3 / 43.6 / 156 / 637 / 2029 ms, `float_linear` on the float weights 18.6 / 26.6 / 39.8 / 110 /
    413 / 1675, MKL on them 26.8 / 45.6 / 62.8 / 162 / 549 / 2128; dequantizing then `float_linear`, 68.6 at
    33 rows against 65.6 on weights already float."""
    rows = _block_rows(x, blocks, bias)
    if rows is None:
        return None
    if rows.shape[0] > MAX_ROWS_QUANTIZED:
        weight = ops.gguf_dequantize(blocks, ggml_type, k)
        return ops.float_linear(rows, weight, bias).view(*x.shape[:-1], blocks.shape[0])
    return ops.gguf_linear(rows, blocks, ggml_type, k, bias).view(*x.shape[:-1], blocks.shape[0])


def int8_rows(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """A Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 weight's product with the rows quantized to 8 bits per 32 values (a Q4_K /
    Q5_K / Q6_K weight's: per 256 values), as llama.cpp computes it (`csrc/gguf_int8_dot.cpp`; the engine's `activations="int8"`), at any row count (decode
    steps and prefill chunks alike, as llama.cpp's CPU products)."""
    rows = _block_rows(x, blocks, bias)
    if rows is None:
        return None
    return ops.gguf_linear_int8(rows, blocks, ggml_type, k, bias).view(*x.shape[:-1], blocks.shape[0])


class PackedWeights:
    """Copies of a model's bf16 weights in a kernel's own layout, one per weight tensor and layout, made
    at its first product and kept until the weights change: `clear()` at the engine's weight-version
    bump, and a tensor written in place (its version counter moved; an inference tensor keeps none, so
    `clear()` is its only signal) is packed again. Two layouts: oneDNN's blocked one (`"onednn"`, the
    same numbers as `F.linear`'s, for products that must equal a trainer's) and k-pairs (`"pairs"`,
    `csrc/pair_linear.cpp`, a bf16 engine's own steps). One per process (`packed_weights()`)."""

    def __init__(self) -> None:
        self._packs: dict[tuple[int, str], tuple[weakref.ref[torch.Tensor], tuple, torch.Tensor]] = {}
        self.generation = 0  # moves at every `clear()`: what a list of copies kept elsewhere checks

    def clear(self) -> None:
        self._packs.clear()
        self.generation += 1

    @property
    def nbytes(self) -> int:
        """Memory the packed copies hold."""
        return sum(packed.numel() * packed.element_size() for _, _, packed in self._packs.values())

    def packed(self, weight: torch.Tensor, layout: str = "onednn", up: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`'s copy in `layout`; for `"gate_up"`, an MLP's gate weight and its `up` weight in one
        copy, interleaved 32 rows at a time (kept while both are unchanged)."""
        key = (id(weight), layout)
        version = (-1 if weight.is_inference() else weight._version,  # inference tensors keep no counter
                   None if up is None else (id(up), -1 if up.is_inference() else up._version))
        entry = self._packs.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == version:
            return entry[2]
        if layout == "pairs":
            packed = ops.pack_pairs(weight.detach())
        elif layout == "gate_up":
            features, inputs = weight.shape
            both = torch.stack([weight.detach().reshape(-1, 32, inputs), up.detach().reshape(-1, 32, inputs)], 1)
            packed = ops.pack_pairs(both.reshape(2 * features, inputs))
        elif layout == "expert_pairs":  # a stack [E, N, K] of experts' weights, each as "pairs"
            packed = torch.stack([ops.pack_pairs(w) for w in weight.detach()])
        elif layout == "expert_gate_up":  # [E, 2I, K]: each expert's gate rows then up rows, each as "gate_up"
            experts, features, inputs = weight.shape
            w = weight.detach().reshape(experts, 2, features // 64, 32, inputs).transpose(1, 2)
            packed = torch.stack([ops.pack_pairs(both.reshape(features, inputs)) for both in w])
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)
        self._packs[key] = (weakref.ref(weight, lambda _, key=key: self._packs.pop(key, None)), version, packed)
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """A projection on oneDNN's kernel and the packed copy (the same numbers as `F.linear`; under
        bf16 autocast the rows are cast as autocast casts them), or None for what it does not take."""
        if x.dtype == torch.float32 and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
            x = x.to(torch.bfloat16)
        if not takes(x, weight) or (bias is not None and bias.dtype != torch.bfloat16):
            return None
        rows = x.reshape(-1, x.shape[-1])
        return self.product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    def engine_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """A bf16 engine's projection: on the k-pairs copy where that kernel is built (every row count),
        else 1-2 rows on the dot-product kernel and more on oneDNN's packed copy."""
        if pairs_available() and x.shape[-1] % 2 == 0:
            if not takes(x, weight) or (bias is not None and bias.dtype != torch.bfloat16):
                return None
            return self.pairs_product(_unit_stride_rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])
        if x.numel() <= MAX_ROWS_OVER_PACKED * x.shape[-1]:
            out = few_rows(x, weight, bias)
            if out is not None:
                return out
        return self.linear(x, weight, bias)

    def gate_up(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """A bf16 engine's silu(x @ gate.T) * (x @ up.T) in one pass of the k-pairs kernel: the same
        bits as the two products and `silu_mul` apart, without writing and reading the two products
        (a 2048-row prefill chunk: 2 x 6 MB a layer). None where that kernel is not built, or for
        shapes it does not take (features not a multiple of 32, an odd input size)."""
        if (not pairs_available() or x.shape[-1] % 2 or gate.shape != up.shape or gate.shape[0] % 32
                or not takes(x, gate, up)):
            return None
        out = ops.pair_silu_mul(_unit_stride_rows(x), self.packed(gate, "gate_up", up))
        return out.view(*x.shape[:-1], gate.shape[0])

    def experts(self, rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor
                ) -> torch.Tensor | None:
        """A bf16 engine's mixture-of-experts products (`Routes.experts`): each expert's gate and up in one
        pass of the k-pairs kernel (as `gate_up`) and its down product, on copies of the stacked weights
        laid out once per change. None where that kernel is not built, or for an expert width it does
        not take (a multiple of 32)."""
        width = down.shape[-1]
        if not pairs_available() or rows.shape[-1] % 2 or width % 32 or not takes(rows, gate_up, down):
            return None
        fused, packed_down = self.packed(gate_up, "expert_gate_up"), self.packed(down, "expert_pairs")
        rows = _unit_stride_rows(rows)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                hidden = ops.pair_silu_mul(rows[start:start + count], fused[expert])
                outputs.append(ops.pair_linear(hidden, packed_down[expert], down.shape[1], None))
                start += count
        return torch.cat(outputs)

    def product(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, K] @ weight.T (+ bias), bf16, on the packed copy of `weight`."""
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed(weight), bias, "none", [], "")

    def pairs_product(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, K] @ weight.T (+ bias), bf16, on the k-pairs copy of `weight`."""
        return ops.pair_linear(rows, self.packed(weight, "pairs"), weight.shape[0], bias)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features] whose rows the k-pairs kernels read in place (each row's values adjacent)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@functools.cache
def pairs_available() -> bool:
    """Whether a bf16 engine's products take the k-pairs kernel: built (AVX512-BF16) on a CPU without
    AMX (with AMX the tile kernel of `csrc/decode_linear.cpp` and oneDNN's are the ones measured)."""
    return (ops.decode_linear_available() and not ops.decode_linear_amx()
            and ops.pair_linear_available())


@functools.cache
def packed_weights() -> PackedWeights:
    """The process's packed copies, shared by every runner and by batch-invariant products: one copy
    of each weight, however many engines read it."""
    return PackedWeights()
