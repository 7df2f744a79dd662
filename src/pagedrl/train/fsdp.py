"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the trainer: each rank holds 1/N of every trained
parameter, gradient and AdamW moment; a layer's full weights exist only while it computes.

Sharding follows the model's own structure: each decoder layer is one unit (all-gathered before
its forward and backward, resharded after), then the root takes what is left (embeddings, final
norm, heads), which FSDP2 keeps gathered from the root's forward to its backward. A root's
gathered weights are also what `model.logits(hidden)` multiplies after the forward.

Three moments need the whole model in one rank, outside the forward/backward FSDP2 drives:

- **rollouts and evaluations** (`full_weights`): the engine runs on the trainer's own module, one
  engine per rank over its own prompts, and the ranks take different numbers of engine steps,
  so no collective may run inside a forward. Every module is all-gathered once, kept gathered
  for the whole rollout (reshard-after-forward off), and released after, with FSDP2's
  per-iteration bookkeeping of those forwards cleared (`reset_iter_state`);
- **saving** (`full_state_dict`, `full_optimizer_state`): every rank joins the gathers, rank 0
  writes the Hugging Face folder and the optimizer state with whole tensors, so a checkpoint
  does not depend on how it was sharded;
- **loading** (`accepting_full_tensors`): whole tensors are copied into the shards, each rank
  keeping its own slice (no communication).

A checkpoint saved under DDP resumes under FSDP2 and the other way round: both write whole
tensors with AdamW's parameter order, which sharding does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from pagedrl.model.decoder import DecoderLayer


def shard_model(module: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """`fully_shard` every decoder layer, then the root (in place; the module keeps its class's
    methods). `reshard_after_forward=False` is ZeRO-2 (`shard_grad_op`): layers stay gathered
    from forward to backward, trading memory for one all-gather fewer per layer."""
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"fsdp: {type(module).__name__} has no decoder layers to shard")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(module)
    # FSDP2 takes the first module to run a forward as the root. The engine may first run a
    # submodule (PPO's policy inside the actor-critic), so settle the root now.
    module._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return module


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights(root: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Every parameter of `root` whole on this rank for the block (one all-gather per unit, every
    rank at the same point), so forwards inside it run with no collective: rollouts, evaluation,
    no-grad passes. No gradient may be computed inside. Released after, sharded as before; a
    block nested in another keeps the weights gathered until the outer one ends."""
    if getattr(root, "_pagedrl_gathered", False):
        yield
        return
    modules = _fsdp_modules(root)
    for m in modules:
        m.unshard()
    for m in modules:
        if m is not root:
            m.set_reshard_after_forward(False, recurse=False)
    root._pagedrl_gathered = True
    try:
        yield
    finally:
        root._pagedrl_gathered = False
        for m in modules:
            m.reshard()
            if m is not root:
                m.set_reshard_after_forward(reshard_after_forward, recurse=False)
        # The forwards above were recorded for backward prefetching; none will have a backward.
        root.reset_iter_state()  # type: ignore[attr-defined]


def _full(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A whole CPU copy: a DTensor is gathered from every rank (a collective), a tensor copied;
    None where not `keep` (the ranks that join the gather but do not write)."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().to("cpu", copy=True) if keep else None


def full_state_dict(module: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """The module's state dict with whole tensors on the CPU. Every rank must call it; those
    without `keep` get None."""
    out = {name: _full(t, keep) for name, t in module.state_dict().items()}
    return out if keep else None  # type: ignore[return-value]


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool = True) -> dict[str, Any] | None:
    """`optimizer.state_dict()` with whole tensors: the layout a plain or DDP run saves, so either
    kind of run resumes from it. Every rank must call it; those without `keep` get None."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: _full(v, keep) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state if keep else None


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A whole-tensor optimizer state cut to this rank's shards of the optimizer's parameters (no
    communication: each rank takes its slice), ready for `optimizer.load_state_dict`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def local(value: Any, param: torch.Tensor) -> Any:
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
            return distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        return value

    out = dict(state)
    out["state"] = {i: {k: local(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()}
    return out


class _FillShards(TorchFunctionMode):
    """`shard.copy_(whole)` copies this rank's slice of `whole` into the shard, whatever the split
    (a [1, hidden] value head over two ranks leaves one of them an empty shard)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], DTensor) and not isinstance(args[1], DTensor):
            shard, whole = args[0], args[1]
            piece = distribute_tensor(whole.detach().to(shard.device, shard.dtype), shard.device_mesh,
                                      shard.placements, src_data_rank=None)
            shard.to_local().copy_(piece.to_local())
            return shard
        return func(*args, **kwargs)


def accepting_full_tensors() -> contextlib.AbstractContextManager[Any]:
    """Inside it, copying whole tensors into sharded parameters (`load_state_dict`, an explicit
    `copy_`) fills each rank's shard with its slice (no communication), so an algorithm's
    `load_model` works unchanged on a sharded module."""
    return _FillShards()


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` for plain or sharded gradients: the norm of sharded gradients is the norm
    over all shards of all ranks (`full_tensor` of the partial norm), as torchtitan computes it, so
    clipping scales by the whole gradient's norm, as one process would."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
