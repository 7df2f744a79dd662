"""torch.distributed for the trainer: one process per device under `torchrun`, nothing otherwise.

`torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` reads them and joins the process
group (gloo on CPU, NCCL on CUDA). A plain `python` run gets world size 1 and every helper here is a
no-op, so the loop has one code path. Only rank 0 writes files; the others compute and reduce.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes logs and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: environment variable must be an integer, got {raw!r}") from None


def init_distributed(use_cpu: bool = False) -> DistInfo:
    """Join the process group torchrun describes (if any) and pick this process's device.

    CUDA: device `cuda:LOCAL_RANK` and NCCL. CPU (no GPU, or `use_cpu`): gloo. Calling it again
    in a process that already joined returns the same answer.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available() and not use_cpu
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def all_reduce_sum(values: Sequence[float] | torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Element-wise sum over ranks, in float64 so token counts stay exact. Returns a CPU tensor."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    if info.distributed:
        work = t.to(info.device)
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        t = work.cpu()
    return t


def all_reduce_op(values: Sequence[float] | torch.Tensor, info: DistInfo, op: str) -> torch.Tensor:
    """Element-wise `sum`, `min` or `max` over ranks (float64, CPU result)."""
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op: expected one of {', '.join(ops)}, got {op!r}")
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    if info.distributed and t.numel():
        work = t.to(info.device)
        dist.all_reduce(work, op=ops[op])
        t = work.cpu()
    return t


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (RNG states, say)."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (a resolved checkpoint path, say)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group at the end of a run (torchrun warns otherwise), every rank together, so
    no rank tears its connections down while another is still at work (writing its results): as
    PyTorch advises before `destroy_process_group`. A rank of a finished two-process test run once
    aborted at exit ("terminate called without an active exception") without it."""
    if info.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
