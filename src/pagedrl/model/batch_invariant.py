"""Batch-invariant computation: a token's numbers do not depend on what else is in the batch.

Why: GRPO and PPO sample a rollout with the engine (one decode row per sequence per step, a few
rows per matmul) and then train on the trainer's recompute of the same tokens (a packed batch,
hundreds of rows per matmul). In float32 the two differ by reduction order only (log-probs 3e-6
apart). In bf16 every activation is rounded to 8 bits of mantissa, and a rounding that goes the
other way on one side grows, layer after layer, to the size of bf16's own rounding: the sampled
log-probs end up 3e-2 from the trainer's, and the rollout is off-policy by that much. The cure is
to make every operation whose result depends on the batch compute the same bits on both sides:

- **Matmuls.** oneDNN picks its kernel by the number of rows, and kernels reduce in different
  orders: a row multiplied alone or among 32 rows gets other bits than the same row among 48 or
  among 300 (measured on the default model's projections, bf16 on AMX). Here every product is cut
  into calls whose kernel computes each row as a 32-row call does (`row_splits`): larger calls only
  at sizes a probe has shown to agree with 32-row calls for this weight's shape, dtype and thread
  count (`safe_sizes`, 64 to 1024 rows), so a trainer's forward keeps most of the large-call speed
  and, where oneDNN has no AMX, a decode step its one call a projection; the rows left
  (with AMX, all of a decode step's) in 32-row calls, the last one padded, or where the CPU has AMX in one
  call of the engine's own kernel (`kernels/csrc/decode_linear.cpp`), which sums each output's
  products as a 32-row oneDNN call does whatever the number of rows (a probe checks it per shape,
  `kernel_agrees`): a 64-sequence decode step's 211 projections of the default model take 23 ms
  that way against 52 ms in two 32-row calls.
- **Attention.** Each query row is attended alone, its keys taken in chunks of 16 positions from
  wherever they lie (`kernels/ops.paged_attention`): the engine reads them from the KV
  cache's blocks, the trainer from its packed batch through a table of the tokens each row sees.
  The trainer's backward is the same kernel's: each row recomputes its probabilities from the
  forward's log-sum-exp over the keys it saw.

Everything else the decoder does (embedding, norms, rotary, SiLU, residual adds, the log-softmax)
is row-wise already. The mode is scoped: `scope(True)` turns it on for what runs inside (the
decoder enters it when its `batch_invariant` flag is set, `enable(module)` sets it).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pagedrl.kernels import ops
from pagedrl.model.row_attention import attention_available

SMALL_ROWS = 32  # a call of this many rows computes each row with the small-batch kernel
# Larger calls tried by the probe, largest first; each is used only where it agrees with 32-row calls.
# Below 256 a kernel of another reduction order can show on only a row or two of 64 or 128 (with AMX a
# 64-row call that passed on one draw of random rows failed on the next): those sizes must agree on
# SMALL_PROBE_DRAWS draws. Where oneDNN's kernel has no AMX (AVX512-BF16) every row count computes a
# row alike, and a 64-sequence decode step takes one call a projection instead of two.
LADDER = (1024, 768, 512, 384, 256, 192, 128, 64)
SMALL_CALL = 256  # sizes below it are the small ones
PROBE_DRAWS = 2
SMALL_PROBE_DRAWS = 8

_state = threading.local()


def active() -> bool:
    """Whether the current thread computes batch-invariantly (inside `scope(True)`)."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def scope(on: bool = True) -> Iterator[None]:
    """Batch-invariant matmuls and attention for what runs inside, when `on`."""
    if not on or active():
        yield
        return
    _state.on = True
    try:
        with _RowChunkedMatmuls():
            yield
    finally:
        _state.on = False


def scoped(fn: Callable[..., Any], on: bool) -> Callable[..., Any]:
    """`fn` run inside `scope(on)` (for gradient checkpointing, whose recompute runs outside the
    forward's scope)."""
    if not on:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with scope(True):
            return fn(*args, **kwargs)
    return run


def enable(module: nn.Module, on: bool = True) -> int:
    """Set the `batch_invariant` flag of every decoder backbone inside `module` (a policy, a
    policy with a value head, a LoRA-wrapped model); returns how many were set."""
    count = 0
    for m in module.modules():
        if hasattr(type(m), "batch_invariant"):
            m.batch_invariant = on
            count += 1
    return count


def require(module: nn.Module) -> None:
    """`enable(module)` for an engine asked to be batch-invariant, or why it cannot be."""
    device = next(module.parameters()).device
    if not attention_available(device):
        raise ValueError(f"batch_invariant runs on a CPU where pagedrl's attention kernel builds; "
                         f"this model is on {device}")
    enable(module)


@contextlib.contextmanager
def suspended(module: nn.Module) -> Iterator[None]:
    """The flags `enable` set inside `module` off for a while (a greedy evaluation, whose numbers no
    trainer recomputes, at full speed), set again after."""
    flagged = [m for m in module.modules() if hasattr(type(m), "batch_invariant") and m.batch_invariant]
    for m in flagged:
        m.batch_invariant = False
    try:
        yield
    finally:
        for m in flagged:
            m.batch_invariant = True


# -- matmuls ---------------------------------------------------------------------------------------

def row_splits(rows: int, safe: tuple[int, ...]) -> list[int]:
    """Row counts of the calls a product of `rows` rows is cut into: the largest safe sizes first,
    then 32-row calls; the last call may hold fewer rows (it is padded to 32)."""
    sizes: list[int] = []
    left = rows
    for size in safe:
        while left >= size:
            sizes.append(size)
            left -= size
    while left > 0:
        sizes.append(min(SMALL_ROWS, left))
        left -= sizes[-1]
    return sizes


def _probe_operands(out_features: int, in_features: int, dtype: torch.dtype, has_bias: bool, seed: int,
                    draws: int = PROBE_DRAWS) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """A probe's random weight [out, in] (and bias) and its `draws` draws of 1024 rows."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if has_bias else None
    return w, b, [torch.randn(LADDER[0], in_features, generator=gen).to(dtype) for _ in range(draws)]


def _by_small_calls(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`call` over `x` in 32-row calls, concatenated: what every probe compares with."""
    return torch.cat([call(x[i:i + SMALL_ROWS]) for i in range(0, x.shape[0], SMALL_ROWS)])


@functools.cache
def safe_sizes(kind: str, out_features: int, in_features: int, dtype: torch.dtype, has_bias: bool,
               threads: int) -> tuple[int, ...]:
    """The `LADDER` sizes at which one call computes every row as 32-row calls do, for a product of
    this shape: measured once per process, on `PROBE_DRAWS` draws of 1024 random rows each cut
    into calls of the size (a kernel that reduces in another order shows it on several rows of
    every few hundred); the sizes below `SMALL_CALL` on `SMALL_PROBE_DRAWS` in all, the further
    draws of 256 rows."""
    w, b, draws = _probe_operands(out_features, in_features, dtype, has_bias, seed=0, draws=SMALL_PROBE_DRAWS)

    def call(rows: torch.Tensor) -> torch.Tensor:
        if kind == "addmm":
            assert b is not None
            return torch.addmm(b.expand(rows.shape[0], -1), rows, w.t())
        return F.linear(rows, w, b)

    safe = list(LADDER)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for drawn, x in enumerate(draws):
            if drawn >= PROBE_DRAWS:  # the small sizes only, on a quarter of the rows
                if all(size >= SMALL_CALL for size in safe):
                    break
                x = x[:SMALL_CALL]
            reference = _by_small_calls(call, x)
            safe = [size for size in safe if (drawn >= PROBE_DRAWS and size >= SMALL_CALL)
                    or all(torch.equal(call(x[i:i + size]), reference[i:i + size])
                           for i in range(0, x.shape[0] - size + 1, size))]
    return tuple(safe)


def _chunked(rows: torch.Tensor, call: Callable[[torch.Tensor, slice], torch.Tensor], safe: tuple[int, ...],
             rest: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`call` over `rows` [M, K] cut by `row_splits`, the results concatenated: call(chunk, where)
    gets the chunk's rows (a short last chunk padded to 32) and the slice of M they came from.
    `rest`: a product that computes any number of rows as 32-row calls do; the rows left after the
    safe sizes go to it in one call instead of 32-row calls."""
    total = rows.shape[0]
    if total in safe or (total == SMALL_ROWS and rest is None):  # one call as it stands
        return call(rows, slice(0, total))
    parts, start = [], 0
    for size in row_splits(total, safe):
        where = slice(start, start + size)
        chunk = rows[where]
        if rest is not None and size not in safe:  # the rows after the safe sizes, in one call
            parts.append(rest(rows[start:]))
            break
        if size < SMALL_ROWS:
            parts.append(call(F.pad(chunk, (0, 0, 0, SMALL_ROWS - size)), where)[:size])
        else:
            parts.append(call(chunk, where))
        start += size
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _lowered(*tensors: torch.Tensor | None) -> tuple[Any, ...]:
    """The casts autocast would make for a matmul (floating operands to its dtype), made before the
    chunked function, as differentiable ops of their own, so gradients reach float32 masters."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _amx_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the engine's AMX kernel takes this product: bf16 operands with contiguous rows, K a
    multiple of 32, and a CPU where it runs."""
    if rows.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return False
    if rows.stride(-1) != 1 or weight.stride(-1) != 1 or rows.shape[-1] % 32 or weight.shape[0] < 16:
        return False
    return ops.decode_linear_amx()


@functools.cache
def kernel_agrees(out_features: int, in_features: int, has_bias: bool, threads: int) -> bool:
    """Whether the engine's AMX kernel computes a bf16 product of this shape as oneDNN's 32-row calls
    do, bit for bit: both sum each output's products 32 at a time in order with the same tile
    instruction and round once (measured equal on the default model's shapes). Checked once per
    process on `PROBE_DRAWS` draws of 1024 random rows, as `safe_sizes` checks oneDNN's own sizes."""
    w, b, draws = _probe_operands(out_features, in_features, torch.bfloat16, has_bias, seed=1)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for x in draws:
            if not torch.equal(ops.decode_linear(x, w, b), _by_small_calls(lambda r: F.linear(r, w, b), x)):
                return False
    return True


@functools.cache
def packed_agrees(out_features: int, in_features: int, has_bias: bool, threads: int, safe: tuple[int, ...]) -> bool:
    """Whether oneDNN's kernel on a packed bf16 weight (`engine.products.PackedWeights`, without
    AMX) computes calls of 32 rows and of the `safe` sizes as `F.linear`'s 32-row calls do, bit for
    bit: the same kernel without the per-call reorder. Checked once per process and shape."""
    from pagedrl.kernels import products

    w, b, draws = _probe_operands(out_features, in_features, torch.bfloat16, has_bias, seed=2, draws=1)
    packed = products.PackedWeights()
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x = draws[0]
        reference = _by_small_calls(lambda r: F.linear(r, w, b), x)
        return all(torch.equal(packed.product(x[i:i + size], w, b), reference[i:i + size])
                   for size in (SMALL_ROWS, *safe) for i in range(0, x.shape[0] - size + 1, size))


def _packed_call(weight: torch.Tensor, bias: torch.Tensor | None, safe: tuple[int, ...]
                 ) -> Callable[[torch.Tensor, slice], torch.Tensor] | None:
    """Calls on a packed copy of `weight` where that computes as `F.linear` does (a rollout engine's
    decode step: 64 rows at 0.75x the time of a call that reorders the weight), else None."""
    from pagedrl.kernels import products

    if weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16) or not products.packs_weights():
        return None
    if not packed_agrees(weight.shape[0], weight.shape[1], bias is not None, torch.get_num_threads(), safe):
        return None
    packs = products.packed_weights()
    return lambda chunk, _: packs.product(chunk, weight, bias)


_SCRATCH: dict[int, weakref.ref] = {}


def scratch(buffer: torch.Tensor) -> torch.Tensor:
    """Marks `buffer` as rewritten between products (a quantized layer's dequantized weight, one buffer
    for every layer of its shape): never packed, since a packed copy, kept by the tensor's identity and
    version, would go stale, and an engine step's buffer (an inference tensor) keeps no version to tell."""
    key = id(buffer)
    _SCRATCH[key] = weakref.ref(buffer, lambda _, key=key: _SCRATCH.pop(key, None))
    return buffer


def _is_scratch(weight: torch.Tensor) -> bool:
    ref = _SCRATCH.get(id(weight))
    return ref is not None and ref() is weight


def _linear_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 persistent: bool = False) -> torch.Tensor:
    """`persistent`: `weight` outlives the call (not a cast made for it), so a packed copy of it pays."""
    N, K, threads = weight.shape[0], weight.shape[1], torch.get_num_threads()
    safe = safe_sizes("linear", N, K, rows.dtype, bias is not None, threads)
    rest = None
    if _amx_product(rows, weight, bias) and kernel_agrees(N, K, bias is not None, threads):
        rest = lambda chunk: ops.decode_linear(chunk, weight, bias)  # noqa: E731
    call = (_packed_call(weight, bias, safe) if persistent and rest is None else None) or (
        lambda chunk, _: F.linear(chunk, weight, bias))
    return _chunked(rows, call, safe, rest)


class _Linear(torch.autograd.Function):
    """Forward cut into invariant calls; backward as two whole products (the gradient need not be
    invariant, and a product per chunk cost a bf16 GRPO step 1.7x its time)."""

    @staticmethod
    def forward(ctx, rows, weight, bias):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _linear_rows(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


class _AddMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mat1, mat2, beta, alpha):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(mat1, mat2)
        ctx.input_shape, ctx.beta, ctx.alpha = input.shape, beta, alpha
        full = input.expand(mat1.shape[0], mat2.shape[1])
        safe = safe_sizes("addmm", mat2.shape[1], mat2.shape[0], mat1.dtype, True, torch.get_num_threads())

        def call(chunk: torch.Tensor, where: slice) -> torch.Tensor:
            added = full[where]
            if added.shape[0] < chunk.shape[0]:
                added = torch.cat([added, added.new_zeros(chunk.shape[0] - added.shape[0], added.shape[1])])
            return torch.addmm(added, chunk, mat2, beta=beta, alpha=alpha)
        return _chunked(mat1, call, safe)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        mat1, mat2 = ctx.saved_tensors
        grad_input = (grad * ctx.beta).sum_to_size(ctx.input_shape) if ctx.needs_input_grad[0] else None
        grad_mat1 = (grad @ mat2.t()) * ctx.alpha if ctx.needs_input_grad[1] else None
        grad_mat2 = (mat1.t() @ grad) * ctx.alpha if ctx.needs_input_grad[2] else None
        return grad_input, grad_mat1, grad_mat2, None, None


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose every row is computed as a 32-row call computes it."""
    if x.device.type != "cpu" or x.numel() == 0:
        return F.linear(x, weight, bias)
    # Operands lowered as autocast would lower them: autocast then leaves the chunks' calls alone.
    given = weight
    x, weight, bias = _lowered(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, weight, bias)):
        out = _Linear.apply(rows, weight, bias)
    else:  # inference (the engine): no autograd node to build
        out = _linear_rows(rows, weight, bias, persistent=weight is given and not _is_scratch(given))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def invariant_addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1,
                    alpha: Any = 1) -> torch.Tensor:
    """`torch.addmm` (input + mat1 @ mat2, input of one row per row of mat1 or broadcast) row by row
    as `invariant_linear` computes."""
    if mat1.device.type != "cpu" or mat1.shape[0] == 0:
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    input, mat1, mat2 = _lowered(input, mat1, mat2)
    return _AddMM.apply(input, mat1, mat2, beta, alpha)


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return invariant_linear(a, b.t())


class _RowChunkedMatmuls(TorchFunctionMode):
    """Sends the decoder's matmuls (`F.linear`, `torch.addmm`, `torch.mm`) through the invariant
    versions; everything else passes through untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func is torch.addmm and "out" not in kwargs and args[1].dim() == 2:
            return invariant_addmm(*args, **kwargs)
        if func is torch.mm and "out" not in kwargs:
            return invariant_mm(*args, **kwargs)
        return func(*args, **kwargs)
