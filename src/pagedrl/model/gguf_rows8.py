"""The `rows8` layout: a quantized weight's blocks of 8 rows interleaved, what a few rows' 8-bit products
read fastest (`kernels/csrc/gguf_int8_rows8.h` for Q4_0 / Q4_1 / Q5_0 / Q5_1, `gguf_int8_krows8.h` for Q4_K /
Q5_K, which state the layouts). The same bytes moved (the K-quants' 6-bit scales regrouped); a kernel
is told by ROWS8 added to the GGML type id."""

from __future__ import annotations

import torch

from pagedrl.model import gguf_dequant

ROWS8 = 256
ROWS8_TYPES = (2, 3, 6, 7, 12, 13)
_K_ROWS8 = (12, 13)


def _rows8_fields(ggml_type: int) -> list[int]:
    """A block's fields before its 16 nibble bytes, in bytes: the halves (d; the `_1` types' m), Q5's
    32-bit word of fifth bits."""
    return ([2, 2] if ggml_type in (3, 7) else [2]) + ([4] if ggml_type in (6, 7) else [])


def _pack_k_rows8(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Q4_K / Q5_K blocks [groups, 8 rows, nb, size] -> per group and block the layout's 8 * size bytes
    [groups, nb, 8 * size] (`csrc/gguf_int8_krows8.h` states it)."""
    groups, _, nb, size = b.shape
    b = b.permute(0, 2, 1, 3)  # [groups, nb, row, size]
    flat = b.reshape(-1, size)
    sc, mn = (t.reshape(groups, nb, 8, 8) for t in gguf_dequant.scale_min(flat[:, 4:16]))  # [.., row, j]
    low = ((sc & 15) | ((mn & 15) << 4)).transpose(-1, -2)  # [.., j, row]
    top = (sc >> 4) | ((mn >> 4) << 2)
    high = (top[..., :4] | (top[..., 4:] << 4)).transpose(-1, -2)  # [.., j % 4, row], j / 4 the nibble
    parts = [b[..., 0:2], b[..., 2:4], low, high]
    if ggml_type == 13:  # the fifth bits in 4-byte chunks, chunk-major
        parts.append(b[..., 16:48].reshape(groups, nb, 8, 8, 4).transpose(2, 3))
    at = 48 if ggml_type == 13 else 16
    parts.append(b[..., at:].reshape(groups, nb, 8, 4, 8, 4).permute(0, 1, 3, 4, 2, 5))  # [.., p, c, row, 4]
    return torch.cat([part.reshape(groups, nb, -1) for part in parts], dim=-1)


def _unpack_k_rows8(p: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """`_pack_k_rows8`'s inverse: [groups, nb, 8 * size] -> [groups, 8 rows, nb, size]."""
    groups, nb, _ = p.shape
    low = p[..., 32:96].reshape(groups, nb, 8, 8).transpose(-1, -2)  # [.., row, j]
    high = p[..., 96:128].reshape(groups, nb, 4, 8).transpose(-1, -2)  # [.., row, j % 4]
    top = torch.cat([high & 15, high >> 4], dim=-1)  # [.., row, j]
    sc, mn = (low & 15) | ((top & 3) << 4), (low >> 4) | ((top >> 2) << 4)
    scales = gguf_dequant.pack_scale_min(sc.reshape(-1, 8), mn.reshape(-1, 8)).reshape(groups, nb, 8, 12)
    parts = [p[..., 0:16].reshape(groups, nb, 8, 2), p[..., 16:32].reshape(groups, nb, 8, 2), scales]
    at = 128
    if ggml_type == 13:
        parts.append(p[..., 128:384].reshape(groups, nb, 8, 8, 4).transpose(2, 3).reshape(groups, nb, 8, 32))
        at = 384
    parts.append(p[..., at:].reshape(groups, nb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(groups, nb, 8, 128))
    return torch.cat(parts, dim=-1).permute(0, 2, 1, 3)


def pack_rows8(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K weight's blocks [N, row_bytes] (N a multiple of 8) in the
    `rows8` layout, the same bytes moved (K-quants' 6-bit scales regrouped): per 8 rows and block, each field
    of the 8 rows side by side (scales, minimums, fifth bits), then the nibbles in 4-byte chunks, chunk-major."""
    size = gguf_dequant.FORMATS[ggml_type].nbytes
    groups, nb = blocks.shape[0] // 8, blocks.shape[1] // size
    b = blocks.reshape(groups, 8, nb, size)
    if ggml_type in _K_ROWS8:
        return _pack_k_rows8(b, ggml_type).reshape(blocks.shape).contiguous()
    parts, at = [], 0
    for width in _rows8_fields(ggml_type):
        parts.append(b[..., at:at + width].permute(0, 2, 1, 3).reshape(groups, nb, 8 * width))
        at += width
    parts.append(b[..., at:].reshape(groups, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 128))
    return torch.cat(parts, dim=-1).reshape(blocks.shape).contiguous()


def unpack_rows8(packed: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """`pack_rows8`'s inverse: the blocks in the file's layout."""
    size = gguf_dequant.FORMATS[ggml_type].nbytes
    groups, nb = packed.shape[0] // 8, packed.shape[1] // size
    p = packed.reshape(groups, nb, 8 * size)
    if ggml_type in _K_ROWS8:
        return _unpack_k_rows8(p, ggml_type).reshape(packed.shape).contiguous()
    parts, at = [], 0
    for width in _rows8_fields(ggml_type):
        parts.append(p[..., at:at + 8 * width].reshape(groups, nb, 8, width).permute(0, 2, 1, 3))
        at += 8 * width
    parts.append(p[..., at:].reshape(groups, nb, 4, 8, 4).permute(0, 3, 1, 2, 4).reshape(groups, 8, nb, 16))
    return torch.cat(parts, dim=-1).reshape(packed.shape).contiguous()
