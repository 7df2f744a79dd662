"""The runs tests/test_parallel.py compares: one process against two gloo processes (DDP and FSDP2)
with the same global batch. Imported by the test (the one-process reference) and run by
`tests/parallel_worker.py` under torchrun (the two-process runs), so both build the same thing.

Each scenario takes two optimizer steps through the loop's own `accumulate` and `optimizer_step`
and records, on rank 0: the step loss, the step metrics (timings left out), the whole gradient
before and after clipping (gathered from the shards under FSDP2), the gradient norm, and for
GRPO/RLOO/PPO/distillation the rollout (completion ids, advantages) gathered in rank order and, after the steps, a
held-out evaluation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from preference_data import preference_rows, unpaired_rows  # noqa: E402
from tiny_train import arithmetic_rows  # noqa: E402

# dpo_precomputed: DPO with the reference's log-probs computed before training, a strided share per rank.
ALGORITHMS = ("sft", "rm", "dpo", "dpo_precomputed", "grpo", "rloo", "ppo", "distill")
GLOBAL_MICRO_BATCH = {"sft": 4, "rm": 4, "dpo": 4, "dpo_precomputed": 4, "grpo": 16, "rloo": 16, "ppo": 8,  # rows, pairs or completions
                      "distill": 8, "kto": 4}  # (one process); KTO keeps 2 rows per micro-batch under any world size
TIMINGS = ("seconds", "tokens_per_second", "prefix_blocks_shared", "num_tokens")


# LoRA on every projection, without dropout so both runs draw nothing at random.
LORA = {"use_peft": True, "lora_target_modules": ["all-linear"], "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


def token_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """A reward that varies inside groups and between ranks' groups: the completion's ids mod 5."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def build(algorithm: str, model_dir: Path, out: Path, dist: Any, fsdp: str | None, **fields: Any) -> Any:
    """A Trainer for `algorithm` whose global batch does not depend on the world size."""
    from pagedrl.model.loader import load_model
    from pagedrl.train.adapters import SEQ_CLS, attach_lora
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.trainer import Trainer

    per_device = GLOBAL_MICRO_BATCH[algorithm] // dist.world_size
    common = {**dict(model=str(model_dir), output_dir=str(out), max_steps=2, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=2, logging_steps=1, save_steps=1000, seed=0, use_cpu=True,
                     report_to=["jsonl"], fsdp=fsdp, max_grad_norm=0.05), **fields}
    seed_everything(0)
    loaded = load_model(str(model_dir), device="cpu", dtype=torch.float32)
    if algorithm == "sft":
        from pagedrl.train.algorithms.sft import SFT
        from pagedrl.train.offline_config import SFTConfig

        config = SFTConfig(**common, learning_rate=3e-3)
        attach_lora(config, loaded.model)  # as start_run does (a no-op without use_peft)
        algo = SFT(config, loaded.model, loaded.tokenizer, dist, arithmetic_rows(), arithmetic_rows(21)[16:])
    elif algorithm == "rm":
        from pagedrl.model.heads import load_sequence_scorer
        from pagedrl.train.algorithms.rm import RewardModeling
        from pagedrl.train.offline_config import RewardConfig

        config = RewardConfig(**common, learning_rate=1e-3)
        scorer = load_sequence_scorer(model_dir, generator=torch.Generator().manual_seed(0))
        attach_lora(config, scorer, SEQ_CLS, modules_to_save=["score"])
        algo = RewardModeling(config, scorer, loaded.tokenizer, dist, preference_rows(16), preference_rows(5, seed=1))
    elif algorithm in ("dpo", "dpo_precomputed"):
        from pagedrl.train.algorithms.dpo import DPO
        from pagedrl.train.offline_config import DPOConfig

        config = DPOConfig(**common, learning_rate=1e-3, precompute_ref_log_probs=algorithm == "dpo_precomputed")
        attach_lora(config, loaded.model)
        algo = DPO(config, loaded.model, loaded.tokenizer, dist, preference_rows(16), preference_rows(5, seed=1))
    elif algorithm == "kto":  # its KL term is averaged over the ranks, so two processes are not one: see the test
        from pagedrl.train.algorithms.kto import KTO
        from pagedrl.train.offline_config import KTOConfig

        config = KTOConfig(**{**common, "per_device_train_batch_size": 2, "learning_rate": 1e-3})
        reference = load_model(str(model_dir), device="cpu", dtype=torch.float32).model
        with torch.no_grad():  # a reference other than the policy, so that rewards and the KL term are not 0
            for p in reference.parameters():
                p.mul_(1.25)
        algo = KTO(config, loaded.model, loaded.tokenizer, dist, unpaired_rows(16, seed=8), ref_model=reference)
    elif algorithm in ("grpo", "rloo"):
        from pagedrl.train.algorithms.grpo import GRPO
        from pagedrl.train.algorithms.rloo import RLOO
        from pagedrl.train.rl.config import GRPOConfig, RLOOConfig

        task = dict(learning_rate=1e-3, dataset="arithmetic", task_low=1, task_high=9, task_num_eval=5,
                    num_generations=4, max_completion_length=8, beta=0.04)
        # batch statistics over every rank: GRPO's batch std, RLOO's normalisation and KL-penalised rewards
        config = GRPOConfig(**common, **task, scale_rewards="batch") if algorithm == "grpo" else \
            RLOOConfig(**common, **task, normalize_advantages=True)
        attach_lora(config, loaded.model)
        algo = (GRPO if algorithm == "grpo" else RLOO)(config, loaded.model.train(), loaded.tokenizer, dist,
                                                       eos_token_ids=loaded.eos_token_ids,
                                                       reward_funcs=[("token_reward", token_reward)])
    elif algorithm == "distill":
        from pagedrl.train.algorithms.distill import Distillation, DistillationConfig

        config = DistillationConfig(**common, learning_rate=1e-3, dataset="arithmetic", task_low=1, task_high=9,
                                    task_num_eval=5, max_completion_length=8, beta=0.5, temperature=0.9,
                                    teacher_model_name_or_path=str(model_dir))
        teacher = load_model(str(model_dir), device="cpu", dtype=torch.float32).model
        with torch.no_grad():  # another teacher than the student, the same on every rank
            g = torch.Generator().manual_seed(1)
            for p in teacher.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        attach_lora(config, loaded.model)
        algo = Distillation(config, loaded.model.train(), loaded.tokenizer, dist, teacher,
                            eos_token_ids=loaded.eos_token_ids)
    else:
        from pagedrl.train.algorithms.ppo import PPO
        from pagedrl.train.rl.config import PPOConfig
        from pagedrl.train.rl.critic import load_critic, lora_critic

        config = PPOConfig(**common, learning_rate=1e-3, dataset="arithmetic", task_low=1, task_high=9,
                           task_num_eval=5, num_generations=2, max_completion_length=8, num_mini_batches=1,
                           num_ppo_epochs=1, kl_coef=0.1, kl_target=0.01, kl_horizon=100, whiten_rewards=True)
        critic = load_critic(config.critic_init, Path(model_dir), None, torch.device("cpu"), seed=0)
        attach_lora(config, loaded.model)
        if config.use_peft:
            lora_critic(config, critic, loaded.model)
        algo = PPO(config, loaded.model.train(), loaded.tokenizer, dist, critic=critic,
                   eos_token_ids=loaded.eos_token_ids, reward_funcs=[("token_reward", token_reward)])
    return Trainer(config, algo, dist, progress=False)


def whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().double()


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole(p.grad) for n, p in module.named_parameters() if p.grad is not None}


def run_steps(trainer: Any, steps: int = 2) -> list[dict[str, Any]]:
    """`steps` optimizer steps; what each one computed (every rank must call it)."""
    from pagedrl.train.distributed import gather_objects

    out = []
    clipped: dict[str, torch.Tensor] = {}
    # The gradient AdamW receives: after clipping.
    trainer.optimizer.register_step_pre_hook(lambda *_: clipped.update(gradients(trainer.module)))
    for step in range(1, steps + 1):  # the held-out sets have 5 rows: 3 on one rank, 2 on the other
        result = trainer.accumulate(step)
        grads = gradients(trainer.module)
        norm = trainer.optimizer_step()
        trainer.algorithm.after_optimizer_step(step)
        row: dict[str, Any] = {"loss": result.loss, "grad_norm": norm, "grads": grads, "clipped": dict(clipped),
                               "metrics": {k: v for k, v in result.metrics.values().items()
                                           if not any(t in k for t in TIMINGS)}}
        rollout = getattr(trainer.algorithm, "rollout", None)
        if rollout is not None:
            parts = gather_objects((rollout.completion_ids, rollout.advantages.tolist()
                                    if rollout.advantages.numel() else None), trainer.dist)
            row["completion_ids"] = [c for ids, _ in parts for c in ids]
            if parts[0][1] is not None:
                row["advantages"] = [a for _, adv in parts for a in adv]
        out.append(row)
    # Evaluated as the loop does, after the steps, so no rollout ever reads KV that the evaluation
    # cached (a prompt block computed in another batch may differ in its last bits).
    with trainer.parallel.full_weights():
        out[-1]["evaluation"] = trainer.algorithm.evaluate(steps)
    if hasattr(trainer.algorithm, "kl_ctl"):  # PPO's adaptive coefficient, set by the batch's mean KL
        out[-1]["kl_coef"] = trainer.algorithm.kl_ctl.value
    trainer.algorithm.close()
    return out


def rollout_statistics(dist: Any, dynamic_sampling: bool, scale_rewards: str) -> dict[str, Any]:
    """`collect_rollout` on synthetic groups whose rewards have a different spread on each rank
    (rank 1's prompts score ten times rank 0's): the advantages in rank order, the prompts kept and
    the rounds run. A local `batch` std would differ between ranks; the gathered one cannot."""
    from pagedrl.train.distributed import gather_objects
    from pagedrl.train.examples import PromptOnly
    from pagedrl.train.rl import rollout as rollout_module
    from pagedrl.train.rl.rollout import Rollout, collect_rollout

    G, per_rank = 2, 3
    position = [0]

    def next_rows(total: int):
        lo, hi = dist.rank * total // dist.world_size, (dist.rank + 1) * total // dist.world_size
        ids = list(range(position[0], position[0] + total))[lo:hi]
        position[0] += total
        return [PromptOnly([i], f"p{i}", "") for i in ids], [None] * len(ids)

    def fake_sample(llm, rows, params, seeds=None):
        # Prompt i's two completions score i % 3 and i % 3 + (i % 2) * (1 + 9 * (i >= 3)): every
        # other group has no spread (dynamic sampling drops it), later prompts spread wider.
        comps = [[p.prompt_ids[0], j] for p in rows for j in range(G)]
        return Rollout(list(rows), G, comps, [""] * len(comps), [[0.0, 0.0]] * len(comps),
                       torch.zeros(len(comps), dtype=torch.bool))

    def score(prompts, completions, completion_ids, **kwargs):
        return [float(i % 3 + j * (i % 2) * (1 + 9 * (i >= 3))) for i, j in completion_ids]

    real = rollout_module.sample
    rollout_module.sample = fake_sample
    try:
        r = collect_rollout(None, next_rows, per_rank * (2 // dist.world_size), None, [("score", score)], None,
                            scale_rewards, dynamic_sampling, max_rounds=3, dist=dist)
    finally:
        rollout_module.sample = real
    parts = gather_objects(([p.prompt_ids[0] for p in r.prompts], r.advantages.tolist(), r.rounds), dist)
    return {"prompts": [i for p, _, _ in parts for i in p], "advantages": [a for _, a, _ in parts for a in a],
            "rounds": parts[0][2]}


def full_weights_states(trainer: Any) -> dict[str, bool]:
    """What the sharded policy looks like around a rollout: whole plain tensors inside
    `full_weights` (also nested), shards (DTensors) again after it."""
    from torch.distributed.tensor import DTensor

    module = trainer.module
    shapes = [p.shape for p in module.parameters()]  # a DTensor's shape is the whole tensor's

    def sharded() -> bool:
        return all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in module.parameters())

    def whole() -> bool:
        return [(type(p), p.shape) for p in module.parameters()] == [(torch.nn.Parameter, s) for s in shapes]

    before = sharded()
    with trainer.parallel.full_weights():
        inside = whole()
        with trainer.parallel.full_weights():
            nested = whole()
        still = whole()
    after = sharded()
    trainer.algorithm.close()
    return {"before": before, "inside": inside, "nested": nested, "after_nested": still, "after": after}
