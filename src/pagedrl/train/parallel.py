"""How the trained module is spread over the ranks under torchrun: replicated (DDP, the default)
or sharded (FSDP2, config `fsdp: full_shard`). One process: neither, and every method is a no-op.

The loop asks the same five things of either: the module whose forward it calls, when gradients
cross the network (the last micro-batch of a step only), the gradient norm and clipping, whole
weights on this rank (rollouts, evaluations), and whole tensors to save and to load. Both divide
the summed gradient by the world size (DDP's average, FSDP2's reduce-scatter average), so the
loop's `loss × world_size` gives the sum either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pagedrl.train import fsdp
from pagedrl.train.distributed import DistInfo


class Parallel:
    def __init__(self, module: nn.Module, dist: DistInfo, reshard_after_forward: bool | None = None,
                 find_unused_parameters: bool = False) -> None:
        """`reshard_after_forward` None: DDP; True: FSDP2 full_shard; False: FSDP2 shard_grad_op."""
        self.module, self.dist = module, dist
        self.sharded = reshard_after_forward is not None and dist.distributed
        self.reshard_after_forward = bool(reshard_after_forward)
        self.wrapped: nn.Module = module
        if self.sharded:
            fsdp.shard_model(module, self.reshard_after_forward)
        elif dist.distributed:
            ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False,
                                                   find_unused_parameters=find_unused_parameters)

    @property
    def kind(self) -> str:
        if self.sharded:
            return "FSDP2 " + ("full_shard" if self.reshard_after_forward else "shard_grad_op")
        return "DDP" if self.dist.distributed else "one process"

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's backward: gradients are reduced across ranks only after the
        last one of the step (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`)."""
        if not self.dist.distributed:
            return contextlib.nullcontext()
        if self.sharded:
            self.module.set_requires_gradient_sync(last)  # type: ignore[operator]
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.wrapped.no_sync()  # type: ignore[operator]

    def clip_grad_norm(self, params: Iterable[nn.Parameter], max_norm: float) -> float:
        """The whole gradient's norm (over every shard when sharded), and clip to `max_norm`."""
        return fsdp.clip_grad_norm(params, max_norm)

    def full_weights(self) -> contextlib.AbstractContextManager[Any]:
        """Every parameter whole on this rank for the block (sharded only; replicas already are)."""
        if not self.sharded:
            return contextlib.nullcontext()
        return fsdp.full_weights(self.module, self.reshard_after_forward)

    def model_state(self) -> dict[str, torch.Tensor] | None:
        """Whole tensors of the trained module on rank 0 when sharded (every rank must call it),
        else None: the module's own state dict is whole already."""
        return fsdp.full_state_dict(self.module, keep=self.dist.is_main) if self.sharded else None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's state with whole tensors on rank 0 (every rank must call it when sharded)."""
        if self.sharded:
            return fsdp.full_optimizer_state(optimizer, keep=self.dist.is_main)
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(fsdp.shard_optimizer_state(optimizer, state) if self.sharded else state)

    def loading(self) -> contextlib.AbstractContextManager[Any]:
        """Around an algorithm's `load_model`: whole tensors fill the shards."""
        return fsdp.accepting_full_tensors() if self.sharded else contextlib.nullcontext()
