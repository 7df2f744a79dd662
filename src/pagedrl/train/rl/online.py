"""What GRPO and PPO share as algorithms: prompts from a `PromptSource`, an engine on the policy's
own tensors sized to one rollout, the rollout's sampling params (the single source of the logprob
contract), verifiers, held-out evaluation, sample logging, and the weight-version bump after
every update. Each algorithm adds its rollout processing and its loss."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pagedrl.engine.engine_args import EngineArgs
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.row_attention import attention_available
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import Algorithm
from pagedrl.train.distributed import DistInfo, all_reduce_sum, gather_objects
from pagedrl.train.evaluate import greedy_scores, score_sums
from pagedrl.train.examples import PromptOnly
from pagedrl.train.rl.config import OnlineConfig
from pagedrl.train.rl.prompts import PromptSource
from pagedrl.train.rl.rewards import RewardFunc, last_integer_match, load_reward_function
from pagedrl.train.rl.rollout import Rollout, prompt_seed


def rollout_kv_tokens(config: OnlineConfig, prompts_per_rollout: int, block_size: int = 16,
                      longest_prompt: int = 0) -> int:
    """The KV budget that holds one rollout at once: each prompt once (its blocks are shared by
    the group) and each completion with a block of slack for the copied partial prompt block. Sized
    to the rollout, not to the host, so the engine holds no memory the rollout does not use. A prompt
    counts `max_prompt_length` tokens, or without one the dataset's longest (at least 512)."""
    prompt = config.max_prompt_length or max(512, longest_prompt)
    completions = prompts_per_rollout * config.num_generations
    return prompts_per_rollout * prompt + completions * (config.max_completion_length + block_size)


def rollout_engine_args(config: OnlineConfig, prompts_per_rollout: int, bf16: bool, batch_invariant: bool,
                        longest_prompt: int = 0) -> EngineArgs:
    """The rollout engine's settings: the config's engine fields (`kv_cache_tokens`, `batch_invariant`
    as chosen), the rest what a rollout on the policy's own tensors needs: room for one rollout's
    completions in a step, the trainer's bf16 autocast, and under FSDP2 (whose gathers swap the
    parameters between steps) neither CUDA graphs nor cast copies of the weights."""
    sharded = config.fsdp_reshard_after_forward is not None
    kv_tokens = config.kv_cache_tokens or rollout_kv_tokens(config, prompts_per_rollout, longest_prompt=longest_prompt)
    return EngineArgs(kv_cache_tokens=kv_tokens,
                      seed=config.seed, max_num_seqs=max(256, prompts_per_rollout * config.num_generations),
                      autocast_dtype=torch.bfloat16 if bf16 else None, enforce_eager=sharded, cast_weights=not sharded,
                      batch_invariant=batch_invariant)


def choose_batch_invariance(asked: bool | None, bf16: bool, device: torch.device, layer_rules: bool = False) -> bool:
    """`batch_invariant` as configured, or by default on where training runs in bf16 on a CPU that
    has the row kernel: there bf16's roundings otherwise put the rollout's log-probs ~3e-2 from the
    trainer's, in float32 they are 3e-6 apart without it. `layer_rules`: a model with sliding windows,
    soft-capping (Gemma), attention sinks (gpt-oss) or latent attention (DeepSeek-V3), which the
    trainer's packed row attention does not implement: off."""
    if asked and layer_rules:
        raise ValueError("batch_invariant: true is not implemented for per-layer sliding windows, soft-capped "
                         "attention (Gemma), attention sinks (gpt-oss) or latent attention (DeepSeek-V3); leave "
                         "it unset or false")
    if asked and device.type != "cpu":
        raise ValueError(f"batch_invariant: true runs on a CPU only; this policy is on {device}")
    if asked is not None:
        if asked and not attention_available(device):
            raise ValueError("batch_invariant: true needs the CPU attention kernel, which could not be built here")
        return asked
    return not layer_rules and bf16 and attention_available(device)


class OnlineAlgorithm(Algorithm):
    """Base of the algorithms that generate their own data. Subclasses set `model` (what the
    loop trains) and implement `step_batches`, `count`, `loss`."""

    config: OnlineConfig
    rollout: Rollout | None = None

    def __init__(self, config: OnlineConfig, policy: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 prompts_per_rollout: int, eos_token_ids: list[int] | None = None,
                 reward_funcs: Sequence[tuple[str, RewardFunc]] | None = None,
                 generation_config: dict[str, Any] | None = None, needs_reward_funcs: bool = True) -> None:
        self.config, self.policy, self.tokenizer, self.dist = config, policy, tokenizer, dist
        self.generation_config = generation_config
        self.prompts_per_rollout = prompts_per_rollout  # per rank
        model_config = getattr(policy, "config", None)
        self.source = PromptSource(config, tokenizer, dist, getattr(model_config, "max_model_len", None))
        if reward_funcs is None:
            specs = config.reward_funcs or (["last_integer_match"] if self.source.task and needs_reward_funcs else [])
            if needs_reward_funcs and not specs:
                raise ValueError("reward_funcs: none given; name built-ins or 'file.py:function'")
            reward_funcs = [load_reward_function(s, max_completion_length=config.max_completion_length,
                                                 format_pattern=config.format_pattern,
                                                 overlong_buffer=config.overlong_buffer) for s in specs]
        self.reward_funcs = list(reward_funcs)
        # What held-out accuracy is measured with: the first verifier, or the task's own.
        self.eval_reward: tuple[str, RewardFunc] | None = (
            self.reward_funcs[0] if self.reward_funcs else
            ("last_integer_match", last_integer_match) if self.source.task else None)
        self.eval_rows = self.source.eval_rows() if self.eval_reward is not None else []
        # The engine runs on the policy's parameters themselves: no sync; under the trainer's bf16
        # autocast when it trains under one, so rollouts are drawn from the numbers training computes
        # (the projections from bf16 copies made once per optimizer step: `engine/cast_weights.py`).
        # Sharded (FSDP2), the whole weights are gathered anew for each rollout: no CUDA graph may
        # hold their addresses.
        device = next(policy.parameters()).device
        self.bf16 = bf16 = config.use_bf16(device)
        config_of = getattr(policy, "config", None)
        # (a uniform sliding window too: the trainer's packed row attention does not apply it)
        layer_rules = any(getattr(config_of, rules, None) is not None
                          for rules in ("gemma", "gpt_oss", "deepseek", "uniform_window"))
        self.batch_invariant = choose_batch_invariance(config.batch_invariant, bf16, device, layer_rules)
        self.engine_args = rollout_engine_args(config, prompts_per_rollout, bf16, self.batch_invariant,
                                               self.longest_prompt)
        self.llm = LLM.from_module(policy, tokenizer, eos_token_ids=eos_token_ids,
                                   **self.engine_args.config_kwargs())  # the engine sets the policy's flag
        self.sampling = SamplingParams(n=config.num_generations, temperature=config.temperature, top_p=config.top_p,
                                       top_k=config.top_k, min_p=config.min_p or 0.0,
                                       max_tokens=config.max_completion_length, seed=None)

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt the engine will be given, training's or evaluation's."""
        return max([self.source.longest_prompt, *(len(r.prompt_ids) for r in self.eval_rows)])

    def rollout_line(self) -> str:
        """How the rollouts' log-probs relate to the trainer's, for the start-up summary."""
        if self.batch_invariant:
            return "rollouts: batch-invariant: each sampled log-prob is the trainer's recompute, bit for bit"
        precision = "bf16" if self.bf16 else "float32"
        return f"rollouts: {precision} batches of any size (batch_invariant off): log-probs within {precision} rounding"

    def next_prompts(self, total: int) -> tuple[list[PromptOnly], list[int | None]]:
        """This rank's share of the run's next `total` prompts (over all ranks), each with its own
        sampling seed: a prompt draws the same completions whichever rank samples it and however
        many ranks there are, and a resumed run draws what the uninterrupted one did."""
        rows, positions = self.source.take_share(total)
        return rows, [prompt_seed(self.config.seed, p) for p in positions]

    def completion_values(self) -> dict[str, torch.Tensor]:
        """Per-completion values logged beside each sample completion (an advantage, a score)."""
        return {}

    def sample_completions(self, step: int) -> list[dict[str, Any]]:
        if not self.config.log_completions or self.rollout is None:
            return []
        k = self.config.num_completions_to_print
        return self.rollout.sample_rows(len(self.rollout) if k is None else k, [n for n, _ in self.reward_funcs],
                                        **self.completion_values())

    def after_optimizer_step(self, step: int) -> None:
        # The weights changed under the engine: no KV computed before this may be reused.
        self.llm.bump_weight_version()

    def close(self) -> None:
        """The engine aborts what it is generating and gives back its KV cache."""
        self.llm.close()

    @property
    def evaluates(self) -> bool:
        """Held-out prompts (the task's, or an eval_dataset's) and a reward to score them with."""
        return bool(self.eval_rows) and self.eval_reward is not None

    def evaluate(self, step: int) -> dict[str, Any] | None:
        if not self.eval_rows or self.eval_reward is None:
            return None
        rows = self.eval_rows[self.dist.rank::self.dist.world_size]  # the loop gathers whole weights if sharded
        max_tokens = self.config.eval_max_tokens or self.config.max_completion_length
        with self.llm.batch_invariance_suspended():  # no trainer recomputes these numbers
            values = greedy_scores(self.llm, rows, self.eval_reward, max_tokens)
        self.llm.sleep()
        correct, total, scored = all_reduce_sum(score_sums(values), self.dist).tolist()  # over every rank's share
        shares = gather_objects(values, self.dist)  # rank r scored rows r, r + world, ...
        outcomes = [shares[i % len(shares)][i // len(shares)] for i in range(len(self.eval_rows))]
        if not scored:
            return {"accuracy": float("nan"), "reward": float("nan"), "outcomes": outcomes}
        return {"accuracy": correct / scored, "reward": total / scored, "outcomes": outcomes}

    @property
    def epoch(self) -> float:
        return self.source.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state["prompts"])
