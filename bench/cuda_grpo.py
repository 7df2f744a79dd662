"""`cuda_check.py`'s GRPO part: a few steps of `run_grpo` on the arithmetic task's batch, with the
step time, rollout time, peak memory and the engine-trainer log-prob agreement of each step. On a CPU
(the script's dry run) the same path at a tiny size, through bf16 autocast all the same."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Log = Callable[[str, str], None]


def grpo(folder: Path, steps: int, device: str, log: Log) -> dict[str, Any]:
    """Rollouts under the trainer's bf16 autocast (the default), then, for the log-prob agreement
    only, two steps with the engine in float32 as before (what the agreement was measured against)."""
    from unittest import mock

    from pagedrl.engine.llm import LLM
    from pagedrl.train.rl import online as online_module  # where the rollout engine is built

    out = {"autocast": grpo_run(folder, steps, device, log)}
    from_module = LLM.from_module

    def float32_engine(*args, **kwargs):
        return from_module(*args, **{**kwargs, "autocast_dtype": None})

    with mock.patch.object(online_module.LLM, "from_module", float32_engine):
        out["engine_float32"] = grpo_run(folder, min(steps, 2), device, log, label="engine float32")
    return out


def grpo_run(folder: Path, steps: int, device: str, log: Log, label: str = "engine under autocast") -> dict[str, Any]:
    from pagedrl.train.algorithms.grpo import run_grpo
    from pagedrl.train.rl.config import GRPOConfig

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        size = dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, max_completion_length=64,
                    task_num_eval=64) if device == "cuda" else dict(
                    per_device_train_batch_size=8, gradient_accumulation_steps=1, max_completion_length=4,
                    task_num_eval=8, bf16=True)  # the dry run: tiny, but through the autocast path
        config = GRPOConfig(model=str(folder), dataset="arithmetic", output_dir=tmp, num_generations=8,
                            temperature=1.0, learning_rate=1e-5, max_steps=steps, beta=0.0, logging_steps=1,
                            save_steps=None, report_to=["jsonl"], kv_cache_tokens=16384, **size)
        start = time.perf_counter()
        run_grpo(config, progress=False)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    keys = ("step", "step_time", "rollout/seconds", "rollout/tokens_per_second",
            "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    out = {"steps": [{k: r.get(k) for k in keys} for r in rows], "wall_s": wall, "peak_gib": peak}
    for r in rows:
        log("grpo", f"{label}, step {r.get('step')}: {r['step_time']:.2f} s, rollout {r['rollout/seconds']:.2f} s, "
            f"{r['rollout/tokens_per_second']:.0f} tok/s, logp diff mean "
            f"{r.get('sampling/sampling_logp_difference/mean', float('nan')):.2e}")
    log("grpo", f"{steps} steps in {wall:.1f} s (load and evaluations included), peak {out['peak_gib']:.2f} GiB")
    return out
