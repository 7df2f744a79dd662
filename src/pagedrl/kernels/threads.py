"""The engine's OpenMP threads bound to cores, as vLLM's CPU backend binds its own.

`PAGEDRL_CPU_THREADS_BIND` (vLLM's `VLLM_CPU_OMP_THREADS_BIND`, same values):
- `auto`: thread i on the i-th core this process may run on, when there are at least
  as many such cores as torch's threads (otherwise nothing is bound); under torchrun, local rank r
  takes the r-th share of them (two ranks of one thread each on two cores: core 0 and core 1);
- a list of cores, `0-1` or `0,2,5`: thread i on the i-th of them (as many threads as cores given);
- `nobind` (the default): the kernel places the threads.

Why: each operator is a parallel region whose threads wait for one another at its end. Unbound, a
thread that the kernel moves onto a core another process keeps busy stalls every region: measured
with a neighbour spinning on one of two cores, two unbound threads ran 12-13x slower than on an
idle machine, two bound ones 3x (`bench/bench_threads.py`). On an idle machine binding changes
nothing measurable.

Why not bound by default: the thread that runs the steps is OpenMP's thread 0, so it is bound too,
and every thread it starts afterwards inherits its one core (a tokenizer's thread pool, torch's
inter-op threads, a server's workers). In `pagedrl demo`, one process that serves and then trains,
the run took 7.5 minutes bound against 5.8-5.9 unbound the same hour. vLLM binds in worker processes
that only run the model; here it is for such processes (`pagedrl serve` on a shared machine).

OpenMP keeps a team of threads per thread that starts parallel work, so the
binding is made by the thread that runs the engine's steps, on its first step (a server's engine
thread, a trainer's main thread); the log says where.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from pagedrl.kernels import ops

logger = logging.getLogger(__name__)

ENV = "PAGEDRL_CPU_THREADS_BIND"


def parse_cores(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]; a clear error naming the variable for anything else."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-"))
                if last < first:
                    raise ValueError
                cores.extend(range(first, last + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: expected 'auto', 'nobind' or cores like '0-3,6'") from None
    if len(set(cores)) != len(cores) or any(c < 0 for c in cores):
        raise ValueError(f"{ENV}={text!r}: each core once, none negative")
    return cores


def planned_cores(setting: str, threads: int, allowed: set[int], local_rank: int = 0,
                  local_world: int = 1) -> list[int] | None:
    """The cores thread 0, 1, ... go to, or None for no binding."""
    setting = setting.strip().lower() or "nobind"
    if setting == "nobind":
        return None
    if setting == "auto":
        if len(allowed) < threads * local_world:
            return None
        return sorted(allowed)[local_rank * threads:(local_rank + 1) * threads]
    cores = parse_cores(setting)
    outside = sorted(set(cores) - allowed)
    if outside:
        raise ValueError(f"{ENV}={setting!r}: cores {outside} are not among this process's ({sorted(allowed)})")
    return cores


_bound = threading.local()


def bind_threads() -> list[int] | None:
    """Bind the calling thread's OpenMP team as the setting says, once per thread; the cores, or None."""
    if not hasattr(_bound, "cores"):
        _bound.cores = _bind()
    return _bound.cores


def _bind() -> list[int] | None:
    cores = planned_cores(os.environ.get(ENV, ""), torch.get_num_threads(), os.sched_getaffinity(0),
                          int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if cores is None or not ops.available():
        return None
    if len(cores) != torch.get_num_threads():
        torch.set_num_threads(len(cores))
    done = ops.bind_threads(cores)
    if not all(done):
        logger.warning("could not bind every thread to its core (%s); threads left where they are", cores)
        return None
    logger.info("CPU threads: %d, bound to cores %s (%s=nobind leaves them unbound)", len(cores), cores, ENV)
    return cores
