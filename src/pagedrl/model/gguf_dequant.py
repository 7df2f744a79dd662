"""GGUF block dequantization in torch: a quantized weight's rows of blocks, as the file stores them,
to float32 on the device the bytes are on.

Why it exists: the CPU kernels (`kernels/csrc/gguf_linear.cpp`, reached through
`pagedrl.kernels.ops.gguf_dequantize`) are C++ built for the host; a CUDA device has no such kernel, and
a CPU where the extension is not built has none either. These functions are plain tensor operations, so
the same code runs on both, with no numpy and no host round trip.

The numbers: every value has the float32 bits `gguf.quants.dequantize` (the package's numpy code, the
project's oracle) gives, because each format below is gguf's numpy code transcribed operation by
operation: half scales widened to float32 exactly (subnormals, inf and NaN included), the same integer
unpacking, then the same float32 products and sums in the same order. Every product is exact: a half
has 11 significant bits, a scale at most 7 and a quant at most 5 (23 together, float32 keeps 24), and
none comes near float32's range. So the one rounding is the final sum of Q4_1 and Q5_1 (`d * q + m`) and the
K-quants (`d * q - dm`), rounded once whether a device adds a rounded product or fuses the two into one
multiply-add. And each scale is a multiple of 2^-24 (the smallest half), so no product or sum is a
float32 subnormal: a device that flushes subnormals gives the same bits. Which NaN comes out of
inf * 0 is not part of the contract (its payload follows the hardware), only that it is a NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256  # values in a K-quant super-block


def _aligned(x: torch.Tensor, itemsize: int) -> torch.Tensor:
    """`x` contiguous at a storage offset a `view` to a dtype of `itemsize` bytes accepts (a byte slice
    of a file may start anywhere)."""
    if x.is_contiguous() and x.storage_offset() % itemsize == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _half(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The IEEE half at byte `offset` of each block, widened to float32 exactly: [B, 1]."""
    return _aligned(b[:, offset:offset + 2], 2).view(torch.float16).to(torch.float32)


def _shifted(x: torch.Tensor, count: int, step: int) -> torch.Tensor:
    """`x` [B, ..., n] shifted right by 0, step, ..., (count - 1) step: [B, ..., count, n] (gguf's
    `x.reshape(..., 1, n) >> np.array([...]).reshape(..., count, 1)`)."""
    shifts = torch.arange(0, count * step, step, dtype=torch.uint8, device=x.device)
    return x.unsqueeze(-2) >> shifts.view(count, 1)


def _nibbles(qs: torch.Tensor, n_blocks: int, width: int) -> torch.Tensor:
    """Bytes in runs of `width`, each run's low nibbles then its high ones: [B, runs * 2, width] uint8."""
    return (_shifted(qs.reshape(n_blocks, -1, width), 2, 4) & 0x0F).reshape(n_blocks, -1, width)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d, 32 int8: x * d
    d = _half(b, 0)
    x = b[:, 2:].view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d, 16 bytes of nibbles: d * (q - 8)
    n = b.shape[0]
    d = _half(b, 0)
    qs = _nibbles(b[:, 2:], n, 16).reshape(n, -1).to(torch.int8) - 8
    return d * qs.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m, 16 bytes of nibbles: (d * q) + m
    n = b.shape[0]
    d, m = _half(b, 0), _half(b, 2)
    qs = _nibbles(b[:, 4:], n, 16).reshape(n, -1).to(torch.float32)
    return (d * qs) + m


def _fifth_bits(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0's and Q5_1's fifth bits: bit i of the little-endian uint32 at `offset`, for value i: [B, 32]."""
    bits = _shifted(b[:, offset:offset + 4], 8, 1) & 0x01  # [B, shift, byte]: value 8 * byte + shift
    return bits.transpose(-1, -2).reshape(b.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d, fifth bits, 16 bytes of nibbles: d * (q - 16)
    n = b.shape[0]
    d = _half(b, 0)
    q = (_nibbles(b[:, 6:], n, 16).reshape(n, -1) | (_fifth_bits(b, 2) << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m, fifth bits, 16 bytes of nibbles: (d * q) + m
    n = b.shape[0]
    d, m = _half(b, 0), _half(b, 2)
    q = (_nibbles(b[:, 8:], n, 16).reshape(n, -1) | (_fifth_bits(b, 4) << 4)).to(torch.float32)
    return (d * q) + m


def scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's `Q4_K.get_scale_min`: eight 6-bit scales and eight 6-bit mins packed in 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`scale_min`'s inverse: [n, 8] scales and minimums (6 bits each) -> their 12 bytes [n, 12]."""
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([d, m, m_d], dim=-1)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's header: each sub-block's d * scale and dmin * min, [B, 8, 1] each."""
    n = b.shape[0]
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = scale_min(b[:, 4:16])
    ds = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    return ds, dm


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, scales, 128 bytes of nibbles: d * q - dm
    n = b.shape[0]
    ds, dm = _k_scales(b)
    qs = _nibbles(b[:, 16:], n, 32).to(torch.float32)
    return (ds * qs - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, scales, 32 bytes of fifth bits, nibbles
    n = b.shape[0]
    ds, dm = _k_scales(b)
    ql = _nibbles(b[:, 48:], n, 32)
    qh = (_shifted(b[:, 16:48].reshape(n, -1, 32), 8, 1) & 0x01).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (ds * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 128 bytes low nibbles, 64 of high 2 bits, 16 int8 scales, d
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    d = _half(b, 208)
    d = (d * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(b[:, :128], n, 64).reshape(n, -1, 32)
    qh = (_shifted(b[:, 128:192].reshape(n, -1, 32), 4, 2) & 0x03).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, -1).to(torch.float32)
    return (d * q).reshape(n, QK_K)


_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # gguf's `kvalues`: E2M1 doubled


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # E8M0 byte e, 16 bytes of nibbles: kvalues[q] * 2^(e - 128)
    # gguf's `e8m0_to_fp32_half`: the float32 bits of 2^(e - 128), a subnormal below e = 2; every product
    # is a small integer times a power of two, exact (or inf), on any device, flushing subnormals aside.
    e = b[:, :1].to(torch.int32)
    d = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23).view(torch.float32)
    q = _nibbles(b[:, 1:], b.shape[0], 16).reshape(b.shape[0], 32).to(torch.int64)
    return d * torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)[q]


def _f32(b: torch.Tensor) -> torch.Tensor:  # the bytes viewed, as gguf's `data.view(np.float32)`
    return _aligned(b, 4).view(torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return _aligned(b, 2).view(torch.float16).to(torch.float32)


def _bf16(b: torch.Tensor) -> torch.Tensor:  # gguf's: the 16 bits as the top of a float32's 32
    return (_aligned(b, 2).view(torch.int16).to(torch.int32) << 16).view(torch.float32)


@dataclass(frozen=True)
class Format:
    """A GGML type as this module reads it: a block of `values` weights stored in `nbytes` bytes."""

    name: str
    values: int
    nbytes: int
    decode: Callable[[torch.Tensor], torch.Tensor]  # blocks [B, nbytes] uint8 -> [B, values] float32


# GGML's numbering (gguf.GGMLQuantizationType); the float types as one-value "blocks".
FORMATS: dict[int, Format] = {
    0: Format("F32", 1, 4, _f32),
    1: Format("F16", 1, 2, _f16),
    2: Format("Q4_0", 32, 18, _q4_0),
    3: Format("Q4_1", 32, 20, _q4_1),
    6: Format("Q5_0", 32, 22, _q5_0),
    7: Format("Q5_1", 32, 24, _q5_1),
    8: Format("Q8_0", 32, 34, _q8_0),
    12: Format("Q4_K", QK_K, 144, _q4_k),
    13: Format("Q5_K", QK_K, 176, _q5_k),
    14: Format("Q6_K", QK_K, 210, _q6_k),
    30: Format("BF16", 1, 2, _bf16),
    39: Format("MXFP4", 32, 17, _mxfp4),
}
SUPPORTED = ", ".join(f"{f.name} ({t})" for t, f in FORMATS.items())


def type_name(ggml_type: int) -> str:
    """GGML's name for a type number, or "unknown" (for messages)."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return "unknown"


def format_of(ggml_type: int) -> Format:
    """The block format of `ggml_type`; a ValueError naming it and the supported ones otherwise."""
    fmt = FORMATS.get(int(ggml_type))
    if fmt is None:
        raise ValueError(f"GGML type {int(ggml_type)} ({type_name(int(ggml_type))}) cannot be dequantized; "
                         f"supported: {SUPPORTED}")
    return fmt


def dequantize(blocks: torch.Tensor, ggml_type: int, k: int,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of GGUF blocks [N, row_bytes] uint8, on any device, to their `k` values each: [N, k] on that
    device, every value the float32 bits `gguf.quants.dequantize` gives.

    `out_dtype` (bf16 or fp16 for a GPU's matmul, say) converts the float32 result at the end, rounded
    to nearest even; only the float32 result is the oracle's bits, a narrower one is those bits rounded.
    Refused with a ValueError: a type not in `FORMATS`, bytes that are not uint8 [N, row_bytes], a `k`
    that is not a whole number of blocks, and rows whose length is not `k`'s blocks. F32 rows come back
    as a view of contiguous, aligned bytes (as gguf's do), every other type as a new tensor."""
    fmt = format_of(ggml_type)
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        got = f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"{fmt.name} blocks must be uint8 [N, row_bytes], got {got}")
    if k <= 0 or k % fmt.values:
        raise ValueError(f"k = {k} is not a whole number of {fmt.name} blocks of {fmt.values} values")
    row_bytes = k // fmt.values * fmt.nbytes
    if blocks.shape[1] != row_bytes:
        raise ValueError(f"{fmt.name} rows of k = {k} values take {row_bytes} bytes "
                         f"({fmt.nbytes} a block of {fmt.values}), got {blocks.shape[1]}")
    n = blocks.shape[0]
    if n == 0:  # no rows: nothing to slice (an empty slice's strides do not allow a view as halves)
        return blocks.new_empty((0, k), dtype=out_dtype)
    out = fmt.decode(blocks.reshape(-1, fmt.nbytes)).reshape(n, k)
    return out if out_dtype == torch.float32 else out.to(out_dtype)
