"""RLOO (Ahmadian et al. 2024, "Back to Basics"), as TRL 1.16's RLOOTrainer trains it, on GRPO's loop.

Everything but two pieces is GRPO's: the engine samples G completions per prompt from the policy's own
tensors, the verifiers score them, the batches are packed and trained the same way. What differs:

- the advantage (`rloo_advantages`): each completion's reward, less beta times its KL to the reference
  (the k1 log-ratio of the policy before the update, summed over the completion), less the mean of its
  G - 1 siblings' so penalised rewards; optionally normalised over the whole batch;
- the loss (`rloo_surrogate`): one importance ratio per completion, exp of its summed token log-ratio,
  PPO-clipped against the advantage and averaged over the step's completions; no KL term in the loss
  (it is in the reward) and no rollout importance weights (TRL's RLOO has none).

Under torchrun the rewards and KLs of every rank's completions are gathered before the baselines and the
normalisation, as TRL gathers them, and each rank keeps its own completions' advantages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedrl.train.algorithms.grpo import GRPO, clip_extremes, entropy_metric, sampling_gap_metrics
from pagedrl.train.distributed import all_reduce_sum, gather_objects
from pagedrl.train.losses import rloo_surrogate
from pagedrl.train.metrics import Metric
from pagedrl.train.rl.advantages import nanstd, rloo_advantages
from pagedrl.train.rl.config import RLOOConfig
from pagedrl.train.rl.packing import PackedBatch
from pagedrl.train.rl.rollout import Rollout, collect_rollout


class RLOO(GRPO):
    name = "rloo"
    config: RLOOConfig

    @staticmethod
    def count_unit(config: Any) -> str:
        return "completions"  # TRL: the mean over completions of each one's loss

    def collect(self) -> Rollout:
        """The scored rollout, without GRPO's group advantages: RLOO's are set once the KLs are known
        (`assign_advantages`), from the whole batch's rewards the rollout gathered."""
        return collect_rollout(self.llm, self.next_prompts, self.prompts_per_step, self.sampling, self.reward_funcs,
                               self.config.reward_weights, None, False, dist=self.dist)

    def needs_old_logps(self) -> bool:
        # beta > 0: the KL in the reward is the policy's before the update (TRL's old_per_token_logps)
        return super().needs_old_logps() or self.config.beta > 0

    def sequence_kls(self) -> torch.Tensor:
        """[len(rollout)] each completion's KL to the reference, Σ (old - ref) over its tokens (float64), and
        the rank's KL metric (Σ over tokens, token count); zeros and no metric when beta is 0."""
        assert self.rollout is not None
        kls = torch.zeros(len(self.rollout), dtype=torch.float64)
        self.kl_sums: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.config.beta == 0:
            return kls
        total, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for b in self.batches:
            assert b.old_logps is not None and b.ref_logps is not None
            per_token = (b.old_logps.double() - b.ref_logps.double()).masked_fill(~b.mask, 0.0).cpu()
            kls[b.completion_index.cpu()] = per_token.sum(-1)
            total, tokens = total + per_token.sum(), tokens + float(b.mask.sum())
        self.kl_sums = (total, tokens)
        return kls

    def assign_advantages(self) -> None:
        r = self.rollout
        assert r is not None
        rewards, kls = r.batch_rewards, self.sequence_kls()  # the whole batch's, every rank's in rank order
        world, G = self.dist.world_size, r.num_generations
        if world > 1:  # TRL's gather: the KLs are known only now
            kls = torch.cat(gather_objects(kls, self.dist))
        c = self.config
        advantages, penalised = rloo_advantages(rewards, G, kls, c.beta, c.reward_clip_range, c.normalize_advantages)
        mine = slice(self.dist.rank * len(r), (self.dist.rank + 1) * len(r)) if world > 1 else slice(None)
        r.advantages = advantages[mine].to(torch.float32)
        self.penalised_rewards = penalised[mine]
        super().assign_advantages()

    def count(self, batch: PackedBatch) -> float:
        return float(batch.num_sequences)

    def loss(self, model: Any, b: PackedBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        out_lp, router_logits = self.policy_logps(model, b)
        logp = b.to_padded(out_lp.logps)
        old = b.old_logps if b.old_logps is not None else logp.detach()
        assert b.advantages is not None
        out = rloo_surrogate(logp, old, b.advantages, b.mask, c.epsilon, c.epsilon_high)
        loss = out.loss.sum() / global_count
        metrics = sampling_gap_metrics(old, b)
        metrics["entropy"] = entropy_metric(out_lp, b)
        n = out.ratio.numel()  # TRL counts its clip flags per completion
        for name, flags in (("low", out.is_low_clipped), ("high", out.is_high_clipped),
                            ("region", out.is_region_clipped)):
            metrics[f"clip_ratio/{name}_mean"] = Metric.mean(flags.sum().float(), n)
        metrics.update(clip_extremes(out.is_low_clipped, out.is_high_clipped, b.mask))  # a micro-batch's, as TRL's
        return self.with_router_loss(loss, metrics, router_logits, b)

    def step_metrics(self, step: int) -> dict[str, Any]:
        m = self.rollout_metrics()
        r = self.rollout
        assert r is not None
        # TRL's share of groups whose rewards, the KL penalty in them, all agree (nanstd close to 0)
        std = nanstd(self.penalised_rewards.view(-1, r.num_generations), dim=1)
        zero = torch.isclose(std, torch.zeros_like(std))
        m["frac_reward_zero_std"] = Metric.mean(float(zero.sum()), r.num_prompts)
        if self.kl_sums is not None:  # every rank's tokens; TRL counts at least 1: 0, not NaN, when all are masked
            total, tokens = all_reduce_sum([float(v) for v in self.kl_sums], self.dist).tolist()
            m["kl"] = Metric.mean(total / max(tokens, 1.0))
        return m

    def summary_lines(self) -> list[str]:
        c = self.config
        frozen = "the base model (adapters off)" if self.base_is_reference else "a frozen reference"
        ref = f"reward less beta={c.beta} × the k1 KL to {frozen}" if c.beta > 0 else "no reference model"
        clip = f", rewards clipped to {c.reward_clip_range}" if c.reward_clip_range else ""
        return [
            f"rloo: {self.prompts_per_step} prompts × G={c.num_generations} completions per rank per step, "
            f"{c.max_completion_length} tokens max, temperature {c.temperature}",
            f"rloo: leave-one-out baseline, normalize_advantages={c.normalize_advantages}, {ref}{clip}, "
            f"epsilon={c.epsilon}/{c.epsilon_high or c.epsilon}, num_iterations={c.num_iterations}",
            f"rloo: rewards {', '.join(n for n, _ in self.reward_funcs)}; {len(self.eval_rows)} held-out prompts",
            f"rloo: {self.rollout_line()}",
        ]


def run_rloo(config: RLOOConfig, progress: bool = True) -> Path:
    """Train `config.model` with RLOO; returns `output_dir/final`."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, "RLOO needs")
    algorithm = RLOO(config, loaded.model, loaded.tokenizer, dist, eos_token_ids=loaded.eos_token_ids,
                     generation_config=loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()
