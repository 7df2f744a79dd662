"""The demo's alignment stages: the base model's held-out accuracy and the verifier-labelled pairs
(one engine for both), then GRPO, DPO, the reward model and PPO, each through its own `run_*` or
algorithm class, so the demo measures exactly what `pagedrl grpo|dpo|rm|ppo` would do.

DPO is an offline algorithm: it has no held-out accuracy of its own, so the demo gives it the one
GRPO and PPO log (`eval/accuracy`, greedy, with an engine on the policy's own tensors), measured
on the same problems at the same kind of moments.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pagedrl.demo.plan import DemoPlan
from pagedrl.engine.llm import LLM
from pagedrl.train.algorithms.dpo import DPO
from pagedrl.train.distributed import DistInfo
from pagedrl.train.evaluate import greedy_scores, score_sums
from pagedrl.train.examples import PromptOnly
from pagedrl.train.offline_config import DPOConfig
from pagedrl.train.rl.prompts import PromptSource
from pagedrl.train.rl.rewards import BUILTINS


def verifier() -> tuple[str, Any]:
    """The task's verifier, looked up as GRPO and PPO look it up (`reward_funcs` by name)."""
    return "last_integer_match", BUILTINS["last_integer_match"]


def held_out_rows(plan: DemoPlan, tokenizer: Any) -> list[PromptOnly]:
    """The problems GRPO and PPO evaluate on (their `PromptSource`'s held-out rows)."""
    return PromptSource(plan.grpo(), tokenizer, DistInfo()).eval_rows()


def eval_llm(model: Any, tokenizer: Any, rows: list[PromptOnly], max_tokens: int, seed: int,
             eos_token_ids: list[int] | None = None) -> LLM:
    """An engine on `model`'s own tensors with room for every held-out problem at once."""
    longest = max(len(r.prompt_ids) for r in rows)
    return LLM.from_module(model, tokenizer, eos_token_ids=eos_token_ids, seed=seed,
                           kv_cache_tokens=len(rows) * (longest + max_tokens + 16), max_num_seqs=max(256, len(rows)))


def trainer_numerics_llm(plan: DemoPlan, kv_cache_tokens: int) -> LLM:
    """An engine computing as the trainers' evaluations do: float32 weights, under bf16 autocast
    (from bf16 copies of the projections) where the trainers train in bf16. The base model's
    accuracy is the "before" of every paired test, so it must be measured with the numerics the
    "after" is: a model loaded in bf16 greedily answers a few problems differently."""
    import torch

    from pagedrl.model.loader import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = plan.grpo().use_bf16(device)
    loaded = load_model(plan.model, device=device, dtype=torch.float32)
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, seed=plan.seed,
                           kv_cache_tokens=kv_cache_tokens, autocast_dtype=torch.bfloat16 if bf16 else None)


def baseline_and_pairs(plan: DemoPlan) -> dict[str, Any]:
    """The base model's held-out accuracy, then `pagedrl rlhf`'s pairs stage on the same engine."""
    from pagedrl.train.rlhf import make_pairs

    # Room for one batch of pair prompts (verifier_pairs samples 64 prompts at a time) or every
    # held-out problem, whichever is more: the host's default budget would hold gigabytes unused.
    room = max(64 * plan.pair_generations, plan.num_eval) * (64 + plan.completion_tokens + 32)
    llm = trainer_numerics_llm(plan, room)
    rows = held_out_rows(plan, llm.tokenizer)
    t0 = time.perf_counter()
    outcomes = greedy_scores(llm, rows, verifier(), plan.completion_tokens)
    eval_seconds = time.perf_counter() - t0
    llm.sleep()
    before = llm.stats()
    t0 = time.perf_counter()
    stats = make_pairs(plan.out / "pairs", {"num_prompts": plan.pair_prompts, "num_generations": plan.pair_generations,
                                            "temperature": plan.pair_temperature, "max_tokens": plan.completion_tokens,
                                            "pairs_per_prompt": plan.pairs_per_prompt}, plan.ppo(), llm)
    after = llm.stats()
    shared = (after["num_forked_blocks"] - before["num_forked_blocks"]) + \
        (after["prefix_cache_hits"] - before["prefix_cache_hits"]) // llm.block_size
    correct, _, scored = score_sums(outcomes)
    return {"base_accuracy": correct / scored, "base_outcomes": outcomes, "num_eval": len(rows),
            "eval_seconds": eval_seconds, "pairs_seconds": time.perf_counter() - t0,
            "prefix_blocks_shared": int(shared), **stats}


class DPOWithAccuracy(DPO):
    """DPO whose evaluations also measure held-out accuracy, as GRPO's and PPO's do."""

    def __init__(self, *args: Any, eval_rows: list[PromptOnly], max_tokens: int, eos_token_ids: list[int],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held_out, self.max_tokens = eval_rows, max_tokens
        self.llm = eval_llm(self.model, self.tokenizer, eval_rows, max_tokens, self.config.seed, eos_token_ids)

    def evaluate(self, step: int) -> dict[str, Any] | None:
        out = super().evaluate(step) or {}
        self.llm.bump_weight_version()  # the weights changed since the last evaluation
        outcomes = greedy_scores(self.llm, self.held_out, verifier(), self.max_tokens)
        self.llm.sleep()
        correct, total, scored = score_sums(outcomes)
        return {**out, "accuracy": correct / scored, "reward": total / scored, "outcomes": outcomes}


def run_dpo_with_accuracy(config: DPOConfig, plan: DemoPlan) -> Path:
    """`run_dpo` with `DPOWithAccuracy` as the algorithm."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, "DPO needs")
    algorithm = DPOWithAccuracy(config, loaded.model, loaded.tokenizer, dist,
                                generation_config=loaded.generation_config or None,
                                eval_rows=held_out_rows(plan, loaded.tokenizer), max_tokens=plan.completion_tokens,
                                eos_token_ids=loaded.eos_token_ids)
    return Trainer(config, algorithm, dist, progress=False).train()


def run_method(stage: str, plan: DemoPlan, resume: bool = False) -> Path:
    """Train one stage to its budget (from its newest checkpoint if `resume`); returns `final/`."""
    config: Any = plan.stage_config(stage, resume)
    if stage == "grpo":
        from pagedrl.train.algorithms.grpo import run_grpo

        return run_grpo(config, progress=False)
    if stage == "dpo":
        return run_dpo_with_accuracy(config, plan)
    if stage == "rm":
        from pagedrl.train.algorithms.rm import run_rm

        return run_rm(config, progress=False)
    from pagedrl.train.algorithms.ppo import run_ppo

    return run_ppo(config, progress=False)
