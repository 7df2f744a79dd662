"""A pre-quantized projection's packed tensors read back to integers: for every weight w[n, k] the
integer v = q - z (its code less its zero point) and the scale s of its group, so that w = s * v, the
arithmetic GPTQ, AWQ and compressed-tensors all dequantize by. `model/prequantized.py` then lays (v, s)
out in the engine's blocks.

The packings (each checked in tests/test_prequantized.py against the method's own packer and
dequantizer, never a copy of this file):
- gptq: `qweight` [k * bits / 32, n] int32, 32 / bits codes a word along the inputs, lowest bits first;
  `qzeros` [groups, n * bits / 32] packed the same way along the outputs, each stored minus one in the
  "gptq" checkpoint format (masked, then one added back, as GPTQ's kernels do); `scales` [groups, n];
  `g_idx` [k] the group of each input (act-order: not in input order).
- awq: `qweight` [k, n / 8] and `qzeros` [groups, n / 8], eight 4-bit codes a word along the outputs in
  the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` [groups, n]; the zero points are stored as they are.
- compressed-tensors pack-quantized: `weight_packed` [n, k * bits / 32] along the inputs, each code
  stored plus 2^(bits-1) (signed codes); asymmetric `weight_zero_point` [n * bits / 32, groups] packed
  along the outputs the same way; `weight_scale` [n, groups]; `weight_shape` (`weight_g_idx`, group
  act-order, which compressed-tensors has dropped, is refused). naive-quantized: `weight` int8 [n, k] and `weight_zero_point` [n, groups] as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrl.model.prequantized_config import Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of an AWQ word holds, lowest first


class PackingError(ValueError):
    """Packed tensors that do not fit together: the tensor, its shape and what was expected."""


@dataclass
class Codes:
    """w = scales[row, group] * values[row, input], with group = g_idx[input] (g_idx None: the inputs in
    contiguous groups of k / groups)."""

    values: torch.Tensor  # [n, k] int32
    scales: torch.Tensor  # [n, groups] float64, the stored scales exactly
    g_idx: torch.Tensor | None  # [k] int64
    bits: int  # of the stored codes

    @property
    def contiguous_group(self) -> int | None:
        """The group size when every group is a contiguous run of inputs in order; else None."""
        n, k = self.values.shape
        groups = self.scales.shape[1]
        if k % groups:
            return None
        size = k // groups
        if self.g_idx is not None and not torch.equal(self.g_idx, torch.arange(k) // size):
            return None
        return size

    def dequantized(self) -> torch.Tensor:
        """w in float64 (exact: a stored scale times an integer of at most 9 bits)."""
        index = self.g_idx if self.g_idx is not None else torch.arange(self.values.shape[1]) // (
            self.values.shape[1] // self.scales.shape[1])
        return self.scales[:, index] * self.values.double()


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, lowest bits first, unpacked along `dim` (0: a word's
    codes are consecutive rows; 1: consecutive columns), as int32 in 0 .. 2^bits - 1."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    words = packed.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask
        return codes.reshape(words.shape[0] * shifts.numel(), words.shape[1])
    codes = (words[:, :, None] >> shifts[None, None, :]) & mask
    return codes.reshape(words.shape[0], words.shape[1] * shifts.numel())


def _need(tensors: dict[str, torch.Tensor], name: str, leaf: str) -> torch.Tensor:
    if leaf not in tensors:
        raise PackingError(f"{name}: no {name}.{leaf} beside {', '.join(sorted(tensors))}")
    return tensors[leaf]


def _check(name: str, leaf: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise PackingError(f"{name}.{leaf} has shape {tuple(tensor.shape)}, expected {shape}")


def gptq_codes(tensors: dict[str, torch.Tensor], scheme: Scheme, name: str, k: int, n: int) -> Codes:
    """`scheme` is this module's (`Scheme.for_module`): its bits, and its group_size, sym and desc_act
    checked against the tensors (each mismatch refused naming the field, a `dynamic` rule's where one set it)."""
    bits, per = scheme.bits, 32 // scheme.bits
    qweight, qzeros, scales = (_need(tensors, name, leaf) for leaf in ("qweight", "qzeros", "scales"))
    groups = scales.shape[0]
    if qweight.dim() == 2 and qweight.shape[0] * 32 != k * bits:
        hint = "" if scheme.rule else "; a module packed otherwise needs a quantization_config.dynamic rule"
        raise PackingError(f"{name}.qweight has shape {tuple(qweight.shape)}, expected {(k // per, n)}: {bits}-bit "
                           f"codes of [{k}] inputs ({scheme.where('bits')} = {bits}{hint})")
    _check(name, "qweight", qweight, (k // per, n))
    _check(name, "qzeros", qzeros, (groups, -(-n // per)))
    _check(name, "scales", scales, (groups, n))
    size = scheme.group_size if scheme.group_size not in (None, -1) else -(-k // groups)
    if scheme.group_size is not None and groups != -(-k // size):
        raise PackingError(f"{name}.scales has {groups} groups; {scheme.where('group_size')} = {scheme.group_size} "
                           f"gives {-(-k // size)} for [{k}] inputs")
    q = _unpack(qweight, bits, 0)  # [k, n]
    z = _unpack(qzeros, bits, 1)[:, :n] + (1 if scheme.variant == "gptq" else 0)  # [groups, n]
    if scheme.sym and not bool((z == 1 << (bits - 1)).all()):
        raise PackingError(f"{name}.qzeros: {scheme.where('sym')} is true but the zero points are not all "
                           f"{1 << (bits - 1)}")
    contiguous = torch.arange(k) // size
    g_idx = tensors.get("g_idx")
    g_idx = contiguous if g_idx is None else g_idx.long()
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise PackingError(f"{name}.g_idx must be [{k}] groups in 0..{groups - 1}")
    if scheme.desc_act is False and not torch.equal(g_idx, contiguous):
        raise PackingError(f"{name}.g_idx puts inputs out of order (act-order) but {scheme.where('desc_act')} is "
                           "false")
    values = (q - z[g_idx]).T.contiguous()
    return Codes(values, scales.double().T.contiguous(), g_idx, bits)


def awq_codes(tensors: dict[str, torch.Tensor], name: str, k: int, n: int) -> Codes:
    qweight, qzeros, scales = (_need(tensors, name, leaf) for leaf in ("qweight", "qzeros", "scales"))
    groups = scales.shape[0]
    if n % 8 or k % groups:
        raise PackingError(f"{name}: awq needs outputs in eights and inputs in whole groups; got [{n}, {k}] "
                           f"and {groups} groups")
    _check(name, "qweight", qweight, (k, n // 8))
    _check(name, "qzeros", qzeros, (groups, n // 8))
    _check(name, "scales", scales, (groups, n))
    column = torch.tensor([8 * j + AWQ_ORDER[i] for j in range(n // 8) for i in range(8)])

    def natural(packed: torch.Tensor) -> torch.Tensor:
        out = torch.empty(packed.shape[0], n, dtype=torch.int32)
        out[:, column] = _unpack(packed, 4, 1)
        return out

    q, z = natural(qweight), natural(qzeros)
    values = (q - z.repeat_interleave(k // groups, dim=0)).T.contiguous()
    return Codes(values, scales.double().T.contiguous(), None, 4)


def compressed_tensors_codes(tensors: dict[str, torch.Tensor], name: str, k: int, n: int) -> Codes:
    scales = _need(tensors, name, "weight_scale")
    if scales.dim() == 1:
        scales = scales[:, None]
    groups = scales.shape[1]
    if scales.shape[0] != n or k % groups:
        raise PackingError(f"{name}.weight_scale has shape {tuple(scales.shape)}: not [{n}, groups of {k} inputs]")
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        bits = packed.shape[1] * 32 // k if packed.dim() == 2 else 0
        if bits not in (4, 8) or packed.shape != (n, k * bits // 32):
            raise PackingError(f"{name}.weight_packed has shape {tuple(packed.shape)}: not 4 or 8-bit codes of a "
                               f"[{n}, {k}] weight")
        offset = 1 << (bits - 1)
        q = _unpack(packed, bits, 1)[:, :k] - offset
        z = tensors.get("weight_zero_point")
        if z is not None:
            _check(name, "weight_zero_point", z, (-(-n * bits // 32), groups))
            z = _unpack(z, bits, 0)[:n] - offset
    else:
        q = _need(tensors, name, "weight")
        if q.dtype != torch.int8:
            raise PackingError(f"{name}.weight is {q.dtype}, expected int8 codes (naive-quantized)")
        _check(name, "weight", q, (n, k))
        q, bits = q.to(torch.int32), 8
        z = tensors.get("weight_zero_point")
        if z is not None:
            z = z.reshape(n, groups).to(torch.int32)
    if "weight_g_idx" in tensors:  # (compressed-tensors itself no longer reads or writes it)
        raise PackingError(f"{name}.weight_g_idx: group act-order is not supported in compressed-tensors "
                           "checkpoints (GPTQ's desc_act is)")
    values = q if z is None else q - z.repeat_interleave(k // groups, dim=1)
    return Codes(values.contiguous(), scales.double(), None, bits)
