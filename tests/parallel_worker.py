"""Run by tests/test_parallel.py under `torchrun --nproc_per_node 2`: every scenario of
`parallel_scenarios` in one launch (start-up costs more than the scenarios), results on rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from parallel_scenarios import ALGORITHMS, LORA, build, full_weights_states, rollout_statistics, run_steps  # noqa: E402

from pagedrl.train.distributed import init_distributed, shutdown  # noqa: E402

if __name__ == "__main__":
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist = init_distributed(use_cpu=True)
    results = {}
    for dynamic, scale in ((False, "batch"), (True, "batch"), (True, "group")):
        results[f"rollout-{dynamic}-{scale}"] = rollout_statistics(dist, dynamic, scale)
    for algorithm in ALGORITHMS:
        for fsdp in (None, "full_shard"):
            name = f"{algorithm}-{fsdp or 'ddp'}"
            results[name] = run_steps(build(algorithm, model_dir, out / name, dist, fsdp))
            print(f"rank {dist.rank}: {name} done", flush=True)
    for algorithm in ALGORITHMS:  # LoRA adapters on a frozen base, under DDP
        results[f"{algorithm}-lora"] = run_steps(build(algorithm, model_dir, out / f"{algorithm}-lora", dist, None,
                                                       **LORA))
    results["kto-ddp"] = run_steps(build("kto", model_dir, out / "kto-ddp", dist, None), steps=1)
    results["full-weights"] = full_weights_states(build("grpo", model_dir, out / "full-weights", dist, "full_shard"))
    # PPO's checkpoint under FSDP2: the policy and the critic (its own backbone, or the policy's).
    for critic in ("policy", "shared"):
        build("ppo", model_dir, out / f"ppo-save-{critic}", dist, "full_shard", critic=critic).save_checkpoint()
    # Resume across the two: a DDP checkpoint continued under FSDP2, and an FSDP2 one under DDP.
    for first, then in ((None, "full_shard"), ("full_shard", None)):
        a, b = out / f"run-{first or 'ddp'}", out / f"resumed-{then or 'ddp'}"
        build("sft", model_dir, a, dist, first, save_steps=1, max_steps=3).train()
        build("sft", model_dir, b, dist, then, max_steps=3, resume_from_checkpoint=str(a / "checkpoint-1")).train()
    # PPO with a value head on the policy's backbone (a [1, hidden] tensor: one rank's shard is empty).
    a, b = out / "ppo-run-ddp", out / "ppo-resumed-full_shard"
    build("ppo", model_dir, a, dist, None, critic="shared", save_steps=1, max_steps=3).train()
    build("ppo", model_dir, b, dist, "full_shard", critic="shared", max_steps=3,
          resume_from_checkpoint=str(a / "checkpoint-1")).train()
    if dist.is_main:
        torch.save(results, out / "results.pt")
    shutdown(dist)
