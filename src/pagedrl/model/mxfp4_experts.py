"""gpt-oss's experts kept in MXFP4 (`quantization="mxfp4"` for a published checkpoint, `"gguf"` for a
llama.cpp file): the published form, about 4.25 bits a weight, where the dequantized experts take 16
(bf16) or 32 (float32). gpt-oss-20b is ~13 GB so and ~42 GB in bf16: kept, it fits where the other does not.

Each expert's weight is rows of GGUF MXFP4 blocks (GGML type 39: an E8M0 scale byte, then 16 bytes of
E2M1 nibbles, value i in nibble i // 16 of byte i % 16), one row an output feature. A published checkpoint's
`W_blocks` / `W_scales` (transformers' layout: the same scale byte, value 2j in byte j's low nibble and
2j + 1 in its high one) are relaid into those rows at load, bytes moved and nothing computed
(`hf_rows`), so one kernel serves both sources. `gate_up` keeps transformers' interleaved rows (gate
feature i at row 2i, up at 2i + 1), so its product is the float model's `x @ gate_up_proj` column for
column and the clamped SwiGLU takes it unchanged; a GGUF file's separate gate and up are interleaved so.

A product on a CPU with the kernels is `gguf_linear` (`csrc/gguf_linear.cpp`): x @ W_eᵀ straight from the
blocks, each output the bits `float_linear` gives on the dequantized weight (a float32 sum in k order,
where torch's matmul sums in its own order: the two agree to float32 rounding). Anywhere else (CUDA, no
kernels) an expert's weight is dequantized for its product and dropped (`gguf_dequant`). Biases and the
activation are the float model's. The weights are buffers: nothing here trains (a trainer loads the
float model; LoRA on them is refused by name in `model/expert_lora.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.kernels import ops
from pagedrl.model.gguf_modules import dequantize
from pagedrl.model.moe import Experts

MXFP4_TYPE = 39  # GGMLQuantizationType.MXFP4
BLOCK_VALUES, BLOCK_BYTES = 32, 17


def hf_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 pair, blocks uint8 [..., rows, groups, 16] and scales [..., rows, groups] →
    GGUF MXFP4 rows [..., rows, groups · 17] of the same values (bytes moved, no arithmetic)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., groups, 32], value order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), nibbles), dim=-1).flatten(-2)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., I, x] gate and up → [..., 2I, x] with gate row i at 2i and up row i at 2i + 1."""
    return torch.stack((gate, up), dim=-2).flatten(-3, -2)


class MXFP4Experts(Experts):
    """gpt-oss's E experts with their weights as MXFP4 blocks: `gate_up_blocks` [E, 2I, H/32 · 17] (rows
    interleaved gate/up), `down_blocks` [E, H, I/32 · 17], float biases [E, 2I] and [E, H], and the
    clamped SwiGLU between. Runs grouped as every `Experts` does (one product per expert and weight)."""

    routable = False  # the engine's expert route multiplies stacked float weights

    def __init__(self, gate_up_blocks: torch.Tensor, gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                 down_bias: torch.Tensor, alpha: float, limit: float) -> None:
        nn.Module.__init__(self)  # (no float weights)
        experts, rows, width = gate_up_blocks.shape
        hidden = width // BLOCK_BYTES * BLOCK_VALUES
        intermediate = rows // 2
        expected = {"gate_up_blocks": (gate_up_blocks, (experts, 2 * intermediate, hidden // 32 * BLOCK_BYTES)),
                    "down_blocks": (down_blocks, (experts, hidden, intermediate // 32 * BLOCK_BYTES))}
        for name, (t, shape) in expected.items():
            if t.dtype != torch.uint8 or tuple(t.shape) != shape or width % BLOCK_BYTES or intermediate % 32:
                raise ValueError(f"MXFP4 experts: {name} must be uint8 {list(shape)} (rows of 17-byte blocks of 32 "
                                 f"values), got {t.dtype} {list(t.shape)}")
        if tuple(gate_up_bias.shape) != (experts, rows) or tuple(down_bias.shape) != (experts, hidden):
            raise ValueError(f"MXFP4 experts: biases must be [{experts}, {rows}] and [{experts}, {hidden}], got "
                             f"{list(gate_up_bias.shape)} and {list(down_bias.shape)}")
        self.num_experts, self.intermediate_size, self.hidden_size = experts, intermediate, hidden
        self.alpha, self.limit = alpha, limit
        self.register_buffer("gate_up_blocks", gate_up_blocks.contiguous())
        self.register_buffer("down_blocks", down_blocks.contiguous())
        self.register_buffer("gate_up_proj_bias", gate_up_bias.float())
        self.register_buffer("down_proj_bias", down_bias.float())
        self.adapters = nn.ModuleDict()  # (none: kept weights take no LoRA)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"type=MXFP4, alpha={self.alpha}, limit={self.limit}")

    def product(self, rows: torch.Tensor, blocks: torch.Tensor, k: int, bias: torch.Tensor) -> torch.Tensor:
        """rows [n, k] @ the MXFP4 weight `blocks` [out, k/32 · 17]ᵀ + bias, in rows' dtype."""
        if rows.device.type == "cpu" and rows.dtype == torch.float32 and ops.available():
            return ops.gguf_linear(rows.contiguous(), blocks, MXFP4_TYPE, k, bias)
        return F.linear(rows, dequantize(blocks, MXFP4_TYPE, k, rows.dtype), bias.to(rows.dtype))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        from pagedrl.model.gpt_oss import clamped_swiglu

        gate_up = self.product(rows, self.gate_up_blocks[e], self.hidden_size, self.gate_up_proj_bias[e])
        hidden = clamped_swiglu(gate_up, self.alpha, self.limit)
        return self.product(hidden, self.down_blocks[e], self.intermediate_size, self.down_proj_bias[e])

    def dequantized(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The float model's stacked tensors (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H] and the
        biases): what `ClampedSwiGLUExperts` holds, for tests and for saving a float copy."""
        def weight(blocks: torch.Tensor, k: int) -> torch.Tensor:
            return torch.stack([dequantize(b, MXFP4_TYPE, k, dtype).T for b in blocks])

        return {"gate_up_proj": weight(self.gate_up_blocks, self.hidden_size),
                "gate_up_proj_bias": self.gate_up_proj_bias.to(dtype),
                "down_proj": weight(self.down_blocks, self.intermediate_size),
                "down_proj_bias": self.down_proj_bias.to(dtype)}


def kept_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the MXFP4 experts' blocks hold, bytes their weights would take in float32)."""
    held = floats = 0
    for m in model.modules():
        if isinstance(m, MXFP4Experts):
            for blocks in (m.gate_up_blocks, m.down_blocks):
                held += blocks.numel()
                floats += blocks.numel() // BLOCK_BYTES * BLOCK_VALUES * 4
    return held, floats
