"""MXFP4 expert weights (OCP Microscaling, FP4 E2M1 values with an E8M0 scale per 32), as the published
gpt-oss checkpoints hold them, dequantized at load into the precision the model computes in.

A quantized weight `W` of a layer's experts sits on disk as two tensors:
  `W_blocks` uint8 [E, rows, groups, 16]: 32 four-bit codes per group, two a byte, the low nibble first;
  `W_scales` uint8 [E, rows, groups]: each group's power of two, biased by 127.
A code indexes the 16 E2M1 values (±0, 0.5, 1, 1.5, 2, 3, 4, 6); the weight is that value times
2^(scale - 127). `rows` are the output features, so the dequantized [E, rows, groups · 32] is transposed
to the [E, in, out] the experts multiply by from the right (`model/moe.py`'s `ClampedSwiGLUExperts`).

The arithmetic is transformers' (`integrations/mxfp4.py`, `convert_moe_packed_tensors`): the value times
the power of two in float32 (`torch.ldexp`), rounded once to the model's dtype, so the weights are the
same bits as transformers loads. Expert by expert, so the float32 intermediate is one expert's, not a
layer's.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [E, rows, groups, 16], scales uint8 [E, rows, groups] → [E, groups · 32, rows] in `dtype`."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * 2 * width, rows, dtype=dtype)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    for e in range(experts):
        codes = blocks[e].to(torch.int64)
        values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).flatten(-2)  # [rows, groups, 32]
        values = torch.ldexp(values, (scales[e].to(torch.int32) - 127).unsqueeze(-1))
        out[e] = values.reshape(rows, -1).to(dtype).T
    return out


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype, origins: dict[str, str],
                     source: str) -> dict[str, torch.Tensor]:
    """`state` with each `W_blocks` / `W_scales` pair replaced by `W` dequantized to `dtype` (`origins`
    gets its file). Raises ValueError naming the tensor when a pair is incomplete or misshapen."""
    pairs = [name[: -len(BLOCKS)] for name in state if name.endswith(BLOCKS)]
    for weight in pairs:
        blocks, scales = state.pop(weight + BLOCKS), state.pop(weight + SCALES, None)
        where = origins.get(weight + BLOCKS, source)
        if scales is None:
            raise ValueError(f"{where}: tensor {weight + BLOCKS!r} (MXFP4) has no {weight + SCALES!r} beside it")
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16
                or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
            raise ValueError(f"{where}: MXFP4 tensors {weight + BLOCKS!r} {blocks.dtype} {tuple(blocks.shape)} and "
                             f"{weight + SCALES!r} {scales.dtype} {tuple(scales.shape)} must be uint8 "
                             "[experts, rows, groups, 16] and [experts, rows, groups]")
        state[weight] = dequantize(blocks, scales, dtype)
        if weight + BLOCKS in origins:
            origins[weight] = origins[weight + BLOCKS]
    stray = next((name for name in state if name.endswith(SCALES) and state[name].dtype == torch.uint8), None)
    if stray is not None:
        raise ValueError(f"{origins.get(stray, source)}: tensor {stray!r} (MXFP4 scales) has no "
                         f"{stray[: -len(SCALES)] + BLOCKS!r} beside it")
    return state
