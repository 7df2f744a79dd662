"""GGUF dequantization as tensor operations (`model/gguf_dequant.py`): every value the float32 bits of
`gguf.quants.dequantize` (the package's own numpy code is the oracle) on random blocks with normal,
edge and arbitrary scales and on the default model's tensors of every type in its file; the bits of the
C++ kernels (`ops.gguf_dequantize`); the same bits with subnormals flushed; no host-only operation (the
same code on the meta device, and on CUDA where there is one); bytes at any offset and stride; the
narrow output types; and the refusals."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_linear import EDGE_HALVES, SCALE_OFFSETS, random_blocks, same_bits

from pagedrl.kernels import ops
from pagedrl.model.gguf_dequant import FORMATS, dequantize

BLOCK_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# The CPU always; a GPU where this machine has one (the functions are the same tensor operations there).
DEVICES = ("cpu", *(("cuda",) if torch.cuda.is_available() else ()))


def values(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def draw_blocks(qtype: Q, rows: int, blocks: int, seed: int, scales: str) -> np.ndarray:
    """Rows of `blocks` blocks: scales "small" (finite products), "edge" (±0, subnormals, the largest
    half, ±inf, NaN) or "raw" (whatever the random bytes spell). A float type's bytes are always raw:
    they spell every kind of half, bfloat16 and float32 already."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES or scales == "raw":
        return rng.integers(0, 256, size=(rows, blocks * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    return random_blocks(qtype, rows, blocks, rng, edges=scales == "edge")


def expected(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """The oracle's values as [rows, k]."""
    k = raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * values(qtype)
    if raw.shape[0] == 0:  # gguf's numpy cannot reshape an empty array: no rows, no values
        return np.empty((0, k), np.float32)
    with np.errstate(all="ignore"):  # inf and NaN scales propagate, as they should
        return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], k)


def ours(raw: np.ndarray, qtype: Q, device: str = "cpu", **kwargs) -> torch.Tensor:
    k = raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * values(qtype)
    return dequantize(torch.from_numpy(raw).to(device), int(qtype), k, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None)
@given(qtype=st.sampled_from(BLOCK_TYPES + FLOAT_TYPES), rows=st.integers(0, 9), blocks=st.integers(1, 4),
       scales=st.sampled_from(["small", "edge", "raw"]), seed=st.integers(0, 2**32 - 1))
def test_random_blocks_dequantize_to_gguf_s_bits(device, qtype, rows, blocks, scales, seed) -> None:
    """Any bytes, any number of rows (none too): every value as gguf's numpy computes it, ±0 kept, inf
    and NaN scales propagated alike, on the device the bytes are on."""
    raw = draw_blocks(qtype, rows, blocks, seed, scales)
    out = ours(raw, qtype, device)
    assert out.device.type == device and out.dtype == torch.float32
    assert same_bits(out.cpu(), expected(raw, qtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_edge_scale_in_every_position(qtype, device) -> None:
    """Each edge half as every scale of a block (d and m, d and dmin, d alone), against random quant
    bytes and K-quant scale bytes (a sweep, not a draw)."""
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(len(EDGE_HALVES) ** 2, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for i, (a, b) in enumerate((a, b) for a in EDGE_HALVES for b in EDGE_HALVES):
        for offset, half in zip(SCALE_OFFSETS[qtype], (a, b), strict=False):
            raw[i, offset:offset + 2] = np.array([half], np.uint16).view(np.uint8)
    assert same_bits(ours(raw, qtype, device).cpu(), expected(raw, qtype))


@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K, Q.Q6_K), ids=lambda t: t.name)
def test_every_k_quant_scale_byte_value(qtype) -> None:
    """Every byte value in every byte of a K-quant block's packed scales (the 6-bit unpacking of Q4_K
    and Q5_K, Q6_K's signed int8 scales), one block per (byte, value)."""
    size = GGML_QUANT_SIZES[qtype][1]
    first, count = (192, 16) if qtype == Q.Q6_K else (4, 12)
    raw = np.tile(draw_blocks(qtype, 1, 1, int(qtype), "small"), (count * 256, 1)).reshape(count, 256, size)
    for j in range(count):
        raw[j, :, first + j] = np.arange(256, dtype=np.uint8)
    raw = raw.reshape(-1, size)
    assert same_bits(ours(raw, qtype), expected(raw, qtype))


def test_a_cpu_that_flushes_subnormals_gives_the_same_bits() -> None:
    """Every scale is a multiple of 2^-24 (the smallest half), so no product or sum is a float32
    subnormal: with subnormals flushed to zero (as on a device built for speed) the values are the
    same, edge and arbitrary scales included."""
    cases = [(qtype, draw_blocks(qtype, 16, 4, int(qtype), scales)) for qtype in BLOCK_TYPES + FLOAT_TYPES
             for scales in ("edge", "raw")]
    wanted = [expected(raw, qtype) for qtype, raw in cases]  # before: the flag would flush numpy's too
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        assert torch.tensor([1e-39]).mul(1.0).item() == 0.0  # flushing is on
        got = [ours(raw, qtype) for qtype, raw in cases]
    finally:
        torch.set_flush_denormal(False)
    for (qtype, _), out, want in zip(cases, got, wanted, strict=True):
        assert same_bits(out, want), qtype.name


@functools.cache
def default_model_tensors() -> tuple[gguf.ReaderTensor, ...]:
    """The default model's first and last layers and its tensors outside the layers (the embedding,
    the final norm): every type and every shape in the file, the layers between repeating them."""
    from pagedrl.model.default import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tensors = gguf.GGUFReader(path).tensors
    last = max(int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk."))
    chosen = tuple(t for t in tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", str(last)))
    assert {t.tensor_type for t in chosen} == {t.tensor_type for t in tensors}
    return chosen


def file_rows(t: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's bytes as [rows, row_bytes] uint8 (the reader gives a float tensor as floats)."""
    raw = np.asarray(t.data).view(np.uint8)
    return raw.reshape(-1, raw.shape[-1])


def test_the_default_model_s_tensors_dequantize_to_gguf_s_bits() -> None:
    """The default model's tensors, of every type in the file (its Q4_1 projections, its Q8_0 embedding,
    its F32 norms), and the embedding's float weights quantized to Q8_0, Q4_0 and Q4_1 by
    gguf itself."""
    tensors = default_model_tensors()
    assert {t.tensor_type for t in tensors} >= {Q.Q4_1, Q.Q8_0, Q.F32}
    for t in tensors:
        assert int(t.tensor_type) in FORMATS, t.name
        raw = file_rows(t)
        out = dequantize(torch.from_numpy(raw.copy()), int(t.tensor_type), int(t.shape[0]))
        assert same_bits(out, expected(raw, t.tensor_type)), t.name
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    weights = expected(file_rows(embedding)[:4096], embedding.tensor_type)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = gguf.quants.quantize(weights, qtype)
        assert same_bits(ours(raw, qtype), expected(raw, qtype)), qtype.name


def cpu_kernels() -> None:
    if not ops.available():
        pytest.skip("the C++ kernels are not built on this machine")


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(BLOCK_TYPES), rows=st.integers(1, 9), blocks=st.integers(1, 4),
       scales=st.sampled_from(["small", "edge", "raw"]), seed=st.integers(0, 2**32 - 1))
def test_the_cpu_kernels_give_the_same_bits(qtype, rows, blocks, scales, seed) -> None:
    """`ops.gguf_dequantize` (the C++ kernels) and these functions: one number for every value."""
    cpu_kernels()
    raw = draw_blocks(qtype, rows, blocks, seed, scales)
    k = blocks * values(qtype)
    assert same_bits(ours(raw, qtype), ops.gguf_dequantize(torch.from_numpy(raw), int(qtype), k))


def test_the_cpu_kernels_give_the_same_bits_on_the_default_model() -> None:
    """The default model's block-quantized tensors, through both."""
    cpu_kernels()
    for t in default_model_tensors():
        if t.tensor_type in BLOCK_TYPES:
            data, k = torch.from_numpy(file_rows(t).copy()), int(t.shape[0])
            assert same_bits(dequantize(data, int(t.tensor_type), k), ops.gguf_dequantize(data, int(t.tensor_type), k)), t.name


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_bytes_at_any_offset_and_stride(qtype) -> None:
    """Rows sliced out of a wider buffer at an odd byte offset (a file's bytes start anywhere), and
    every other row: the values of the same rows given contiguously."""
    raw = draw_blocks(qtype, 6, 2, int(qtype), "raw")
    wide = torch.zeros(6, raw.shape[1] + 3, dtype=torch.uint8)
    wide[:, 1:-2] = torch.from_numpy(raw)
    k = 2 * values(qtype)
    assert same_bits(dequantize(wide[:, 1:-2], int(qtype), k), expected(raw, qtype))
    assert same_bits(dequantize(wide[::2, 1:-2], int(qtype), k), expected(raw[::2].copy(), qtype))
    flat = torch.zeros(raw.size + 1, dtype=torch.uint8)
    flat[1:] = torch.from_numpy(raw).flatten()
    assert same_bits(dequantize(flat[1:1 + raw.shape[1]].view(1, -1), int(qtype), k), expected(raw[:1], qtype))


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_no_host_only_operation(qtype) -> None:
    """On the meta device (shapes, no data): no numpy, no `.item()`, no copy to the host anywhere, so
    the code that runs here runs unchanged on a GPU."""
    fmt = FORMATS[int(qtype)]
    blocks = torch.empty(5, 3 * fmt.nbytes, dtype=torch.uint8, device="meta")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = dequantize(blocks, int(qtype), 3 * fmt.values, out_dtype=dtype)
        assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", dtype, (5, 3 * fmt.values))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_a_narrow_output_is_the_oracle_s_bits_rounded(dtype) -> None:
    """bf16 or fp16 for a matmul: the oracle's float32 values rounded to nearest even, nothing else."""
    for qtype in BLOCK_TYPES:
        raw = draw_blocks(qtype, 4, 2, int(qtype), "small")
        out = ours(raw, qtype, out_dtype=dtype)
        want = torch.from_numpy(expected(raw, qtype)).to(dtype)
        assert out.dtype == dtype and same_bits(out.float(), want.float())


def test_wrong_operands_are_refused_with_the_reason() -> None:
    raw = torch.zeros(4, 40, dtype=torch.uint8)  # 4 rows of two Q4_1 blocks: k = 64
    with pytest.raises(ValueError, match=r"GGML type 10 \(Q2_K\) cannot be dequantized; supported: F32 \(0\), "
                                         r"F16 \(1\), Q4_0 \(2\), Q4_1 \(3\), Q5_0 \(6\), Q5_1 \(7\), Q8_0 \(8\), "
                                         r"Q4_K \(12\)"):
        dequantize(raw, int(Q.Q2_K), 64)
    with pytest.raises(ValueError, match=r"GGML type 99 \(unknown\) cannot be dequantized; supported: F32"):
        dequantize(raw, 99, 64)
    with pytest.raises(ValueError, match=r"k = 48 is not a whole number of Q4_1 blocks of 32 values"):
        dequantize(raw, int(Q.Q4_1), 48)
    with pytest.raises(ValueError, match=r"k = 0 is not a whole number of Q4_1 blocks"):
        dequantize(raw, int(Q.Q4_1), 0)
    with pytest.raises(ValueError, match=r"Q4_1 rows of k = 96 values take 60 bytes \(20 a block of 32\), got 40"):
        dequantize(raw, int(Q.Q4_1), 96)
    with pytest.raises(ValueError, match=r"Q6_K rows of k = 256 values take 210 bytes \(210 a block of 256\), got 40"):
        dequantize(raw, int(Q.Q6_K), 256)
    with pytest.raises(ValueError, match=r"Q4_1 blocks must be uint8 \[N, row_bytes\], got torch.float32 \(4, 40\)"):
        dequantize(raw.float(), int(Q.Q4_1), 64)
    with pytest.raises(ValueError, match=r"Q4_1 blocks must be uint8 \[N, row_bytes\], got torch.uint8 \(160,\)"):
        dequantize(raw.flatten(), int(Q.Q4_1), 64)
