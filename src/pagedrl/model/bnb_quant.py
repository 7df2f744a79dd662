"""The weight formats of QLoRA (Dettmers et al. 2023) and LLM.int8 (Dettmers et al. 2022), as
bitsandbytes stores them, in plain torch: what a trainer's frozen base is held in under
`load_in_4bit` / `load_in_8bit`.

4-bit (`quantize_4bit`): the weight is flattened and cut into blocks of 64 values; each block keeps
its absolute maximum (float32) and each value the index of the nearest of 16 code values to
value / absmax, two indices a byte, the first in the high nibble. The code tables are bitsandbytes'
own (`get_4bit_type`): NF4, the quantiles of a normal distribution normalised to [-1, 1] with an
exact zero, and FP4 (1 sign, 2 exponent, 1 mantissa bit, divided by its largest value 12). "Nearest"
is bitsandbytes' decision tree: a value above the midpoint between two codes takes the upper one.

Double quantization (`nested`, bitsandbytes' `compress_statistics`): the block maxima, less their
mean, are themselves quantized in blocks of 256 to bitsandbytes' signed 8-bit dynamic map
(`create_dynamic_map`), saving 0.37 bits a weight (0.5 → 0.127).

8-bit (`quantize_int8_rows`): LLM.int8's weight storage, one absmax scale per output row and
round(w · 127 / absmax) as int8. Only the storage: the outlier decomposition LLM.int8 applies to
activations at matmul time is not done here (the product runs on the dequantized weight).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_4BIT = 64  # bitsandbytes' Params4bit default, the QLoRA paper's
BLOCK_NESTED = 256  # the block maxima's own blocks under double quantization
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
# Indices 0-7 positive (index 8 is -0), in bitsandbytes' bit order: 0b0010 = 8, 0b0011 = 12, ...
_FP4_RAW = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
FP4_CODE = tuple(v / 12.0 for v in _FP4_RAW)
QUANT_TYPES = ("nf4", "fp4")


def code_table(quant_type: str) -> torch.Tensor:
    """The 16 code values of `quant_type` as float32, indexed by the 4-bit code."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"bnb_4bit_quant_type: {quant_type!r} is not supported; choose nf4 or fp4")
    return torch.tensor(NF4_CODE if quant_type == "nf4" else FP4_CODE, dtype=torch.float32)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map(signed=True)`): 256 sorted values in
    [-1, 1], a decimal exponent from 1e-6 to 1 and a linear fraction whose bits grow with it."""
    data: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * (10 ** (-6 + i))
        data += means.tolist() + (-means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def _nearest(values: torch.Tensor, sorted_codes: torch.Tensor) -> torch.Tensor:
    """Position in `sorted_codes` of the nearest code to each value; a value exactly on a midpoint
    takes the lower code (bitsandbytes' `x > midpoint` tests)."""
    midpoints = (sorted_codes[:-1] + sorted_codes[1:]) / 2
    return torch.bucketize(values, midpoints, right=False)


def _code_indices(normalised: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The 4-bit code of each value in [-1, 1]."""
    if quant_type == "nf4":
        return _nearest(normalised, code_table("nf4"))  # the table is sorted: position = code
    # FP4: the magnitude's nearest code among the 8 non-negative ones, plus the sign bit.
    magnitudes = torch.tensor(_FP4_RAW[:8]) / 12.0
    order = torch.argsort(magnitudes)
    index = order[_nearest(normalised.abs(), magnitudes[order])]
    return index + 8 * (normalised < 0).to(index.dtype)


@dataclass
class Quantized4bit:
    """A tensor in bitsandbytes' 4-bit layout."""

    packed: torch.Tensor  # uint8 [ceil(numel / 2)]: two codes a byte, the first in the high nibble
    absmax: torch.Tensor  # float32 [blocks], or uint8 [blocks] under double quantization
    shape: tuple[int, ...]
    quant_type: str
    nested_absmax: torch.Tensor | None = None  # float32 [ceil(blocks / 256)]: the maxima's block maxima
    nested_offset: torch.Tensor | None = None  # float32 []: the mean taken off the maxima

    @property
    def nbytes(self) -> int:
        extra = [t for t in (self.nested_absmax, self.nested_offset) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.packed, self.absmax, *extra))


def _blockwise_absmax(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`flat` zero-padded to whole blocks as [blocks, block], each block's absolute maximum)."""
    pad = -flat.numel() % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    return blocks, blocks.abs().amax(dim=1)


def _normalise(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """blocks / absmax, with an all-zero block kept at zero (bitsandbytes would divide by zero)."""
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    return blocks * scale[:, None]


@torch.no_grad()
def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", nested: bool = False) -> Quantized4bit:
    """`weight` (any float dtype) in blocks of 64 as NF4 or FP4 codes with float32 block maxima."""
    code_table(quant_type)  # the one-line refusal of an unknown type
    flat = weight.detach().reshape(-1).float()
    blocks, absmax = _blockwise_absmax(flat, BLOCK_4BIT)
    codes = _code_indices(_normalise(blocks, absmax), quant_type).to(torch.uint8).reshape(-1)[:flat.numel()]
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = (codes[0::2] << 4) | codes[1::2]
    out = Quantized4bit(packed.contiguous(), absmax, tuple(weight.shape), quant_type)
    if nested:
        offset = absmax.mean()
        centred, absmax2 = _blockwise_absmax(absmax - offset, BLOCK_NESTED)
        q = _nearest(_normalise(centred, absmax2), dynamic_map()).to(torch.uint8).reshape(-1)[:absmax.numel()]
        out.absmax, out.nested_absmax, out.nested_offset = q, absmax2, offset
    return out


def block_maxima(q: Quantized4bit) -> torch.Tensor:
    """The float32 block maxima (dequantized from 8 bits under double quantization)."""
    if q.nested_absmax is None:
        return q.absmax
    assert q.nested_offset is not None
    values = dynamic_map().to(q.absmax.device)[q.absmax.long()]
    pad = -values.numel() % BLOCK_NESTED
    scaled = torch.nn.functional.pad(values, (0, pad)).view(-1, BLOCK_NESTED) * q.nested_absmax[:, None]
    return scaled.reshape(-1)[:values.numel()] + q.nested_offset


@functools.cache
def _byte_pairs(quant_type: str, device: torch.device) -> torch.Tensor:
    """[256, 2] float32: a packed byte's two code values (high nibble first), so that a weight's values
    are one lookup per byte instead of two shifts, a stack and a lookup per value (2x faster)."""
    table = code_table(quant_type).to(device)
    return torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1).contiguous()


def dequantize_4bit(q: Quantized4bit, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """code[index] · absmax of each value, in float32, then rounded to `dtype`: a fresh tensor, or `out`
    (contiguous float32 of the weight's shape, whole blocks) written in place."""
    numel = 1
    for d in q.shape:
        numel *= d
    pairs = _byte_pairs(q.quant_type, q.packed.device)
    if out is not None and numel % BLOCK_4BIT == 0 and out.is_contiguous() and out.dtype == torch.float32:
        torch.index_select(pairs, 0, q.packed.int(), out=out.view(-1, 2))
        out.view(-1, BLOCK_4BIT).mul_(block_maxima(q)[:, None])
        return out
    values = pairs.index_select(0, q.packed.int()).reshape(-1)[:numel]
    if pad := -numel % BLOCK_4BIT:
        values = torch.nn.functional.pad(values, (0, pad))
    scaled = values.view(-1, BLOCK_4BIT) * block_maxima(q)[:, None]
    result = scaled.reshape(-1)[:numel].view(q.shape).to(dtype)
    return result if out is None else out.copy_(result)


@torch.no_grad()
def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8's weight storage: (round(w · 127 / row absmax) as int8 [n, k], row absmax float32 [n])."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1)
    inverse = torch.where(scale > 0, 127.0 / scale, torch.zeros_like(scale))
    return torch.round(w * inverse[:, None]).to(torch.int8), scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · absmax / 127 per row (bitsandbytes' `int8_vectorwise_dequant` constant), then `dtype`."""
    return (q.float() * scale[:, None] * 7.874015718698502e-3).to(dtype)
