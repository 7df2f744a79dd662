"""GRPO (Shao et al. 2024) with DAPO's and Dr. GRPO's options, on the one trainer loop.

Each rollout: the in-process engine samples G completions per prompt from the policy's own
tensors, verifiers score them, and each completion's advantage is its reward against its group's
mean (and std). The loss is the clipped surrogate on the completion tokens, optionally with a KL
to a frozen reference, aggregated as `loss_type` says over the whole step's global batch.

Under torchrun each rank samples its share of the prompts with its own engine; the advantages,
dynamic sampling and metrics are computed over every rank's groups (`collect_rollout`), so two
processes train on what one process with the whole batch would. The reference is frozen and
replicated on every rank (it has no gradient or optimizer state to shard).

A mixture of experts with a router load-balancing loss (Mixtral, Qwen3-MoE, gpt-oss) adds it in
training, as TRL's GRPO trainer does: times `router_aux_loss_coef` (unset: the model config's; 0: not
added) over each micro-batch's policy forward, divided by the step's micro-batches (all ranks), logged
as `aux_loss`. TRL runs each completion with its own copy of the prompt; here a prompt computed once
counts once per completion packed after it (`PackedBatch.token_weights`), which gives TRL's value.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.moe import collect_router_logits
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import reference_forward, uses_lora
from pagedrl.train.distributed import DistInfo, all_reduce_sum
from pagedrl.train.logprobs import TargetLogprobs, target_logprobs
from pagedrl.train.losses import aggregate, clipped_surrogate, kl_estimate, vespo_weights
from pagedrl.train.metrics import Metric
from pagedrl.train.rl.advantages import nanstd
from pagedrl.train.rl.config import GRPOConfig
from pagedrl.train.rl.online import OnlineAlgorithm
from pagedrl.train.rl.packing import PackedBatch, pack, split_units
from pagedrl.train.rl.rewards import RewardFunc
from pagedrl.train.rl.rollout import Rollout, collect_rollout
from pagedrl.train.router_loss import load_balancing_loss, router_loss_coef
from pagedrl.train.tis import tis_ratio_values, tis_weight

TOKEN_MEAN_LOSSES = ("dapo", "bnpo", "cispo", "vespo")


class GRPO(OnlineAlgorithm):
    name = "grpo"
    config: GRPOConfig

    def __init__(self, config: GRPOConfig, model: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 eos_token_ids: list[int] | None = None, reward_funcs: Sequence[tuple[str, RewardFunc]] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        G = config.num_generations
        completions_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        if completions_per_step % G:
            raise ValueError(f"per_device_train_batch_size × gradient_accumulation_steps ({completions_per_step}) "
                             f"must be a multiple of num_generations ({G})")
        self.prompts_per_step = completions_per_step // G  # per rank
        self.examples_per_step = self.prompts_per_step * dist.world_size
        self.normaliser = self.count_unit(config)
        super().__init__(config, model, tokenizer, dist, self.prompts_per_step, eos_token_ids, reward_funcs,
                         generation_config)
        self.model = model
        self.router_coef = router_loss_coef(config.router_aux_loss_coef, model.config)
        self.ref_model = None
        # With LoRA the reference is the base: the policy with its adapters switched off, no copy.
        self.base_is_reference = config.beta > 0 and uses_lora(model)
        if config.beta > 0 and not self.base_is_reference:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.rollout: Rollout | None = None
        self.batches: list[PackedBatch] = []

    # -- prompts and rollouts -------------------------------------------------------------------

    def step_batches(self, step: int) -> list[PackedBatch]:
        # A new rollout every num_iterations steps, and whenever this process has none: a run resumed from a
        # checkpoint saved between the steps of one rollout makes a fresh one, as TRL's emptied buffer does
        if self.rollout is None or (step - 1) % self.config.num_iterations == 0:
            with self.full_weights():  # sharded: the engine and the no-grad passes see whole weights
                self.rollout = self.collect()
                self.llm.sleep()  # the optimizer runs next: the KV cache gives its memory back until the next rollout
                units = split_units(self.rollout, self.config.gradient_accumulation_steps)
                device = next(self.model.parameters()).device
                self.batches = [pack(self.rollout, u, device, self.config.mask_truncated_completions) for u in units]
                self.remember_rollout_logps()
                self.assign_advantages()
        return self.batches

    def collect(self) -> Rollout:
        """The step's scored rollout, with GRPO's group advantages (DAPO's dynamic sampling if asked)."""
        return collect_rollout(self.llm, self.next_prompts, self.prompts_per_step, self.sampling, self.reward_funcs,
                               self.config.reward_weights, self.config.scale_rewards, self.config.dynamic_sampling,
                               dist=self.dist)

    def assign_advantages(self) -> None:
        """Each batch's completions' advantages, from the rollout's (after the rollout's log-probs are
        known: RLOO's depend on them)."""
        assert self.rollout is not None
        device = next(self.model.parameters()).device
        for b in self.batches:
            b.advantages = self.rollout.advantages.to(device)[b.completion_index]

    def needs_old_logps(self) -> bool:
        """Whether the policy's log-probs before the first update are computed apart (μ > 1: the ratio's
        denominator); otherwise the loss's own, detached, are the same numbers."""
        return self.config.num_iterations > 1

    @torch.no_grad()
    def remember_rollout_logps(self) -> None:
        """What stays fixed while one rollout is trained on, computed once per rollout: the
        reference's log-probs (beta > 0), and for μ > 1 the policy's before the first update (the
        ratio's denominator). Under the trainer's autocast, as the loss computes its side of them."""
        device = next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            self._remember_rollout_logps()

    def _remember_rollout_logps(self) -> None:
        for b in self.batches:
            if self.ref_model is not None:
                b.ref_logps = b.to_padded(self.token_logps(self.ref_model, b).logps)
            elif self.base_is_reference:
                with reference_forward(self.model):
                    b.ref_logps = b.to_padded(self.token_logps(self.model, b).logps)
            if self.needs_old_logps():
                b.old_logps = b.to_padded(self.token_logps(self.model, b).logps)

    def token_logps(self, model: Any, b: PackedBatch, entropy: bool = False) -> TargetLogprobs:
        """Processed log-probs of the completion tokens under the rollout's own sampling params
        (the distribution they were drawn from), and on request the entropy."""
        return target_logprobs(model, b.input_ids, b.positions, b.meta, b.predict_at, b.targets,
                               sampling=self.sampling, entropy=entropy)

    # -- the loss --------------------------------------------------------------------------------

    @staticmethod
    def count_unit(config: Any) -> str:
        """What `count` counts, for the start-up summary."""
        return "completion tokens" if config.loss_type in TOKEN_MEAN_LOSSES else "completions"

    def count(self, batch: PackedBatch) -> float:
        if self.config.loss_type in TOKEN_MEAN_LOSSES:
            return float(batch.mask.sum())
        return float(batch.num_sequences)

    def loss(self, model: Any, b: PackedBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        out_lp, router_logits = self.policy_logps(model, b)
        logp = b.to_padded(out_lp.logps)
        old = b.old_logps if b.old_logps is not None else logp.detach()
        mask = b.mask
        w = tis_weight(old, b.sampling_logps, c.tis_cap, c.tis_mode, mask, c.tis_min) if c.tis_correction else None
        phi = None
        if c.loss_type == "vespo":  # the rollout's importance weights go into VESPO's sequence weight, as in TRL
            phi = vespo_weights(logp, old, b.advantages, mask, w, (c.vespo_k_pos, c.vespo_k_neg),
                                (c.vespo_lambda_pos, c.vespo_lambda_neg))
        out = clipped_surrogate(logp, old, b.advantages, mask, c.epsilon, c.epsilon_high, c.delta,
                                cispo=c.loss_type == "cispo",
                                sapo=(c.sapo_temperature_pos, c.sapo_temperature_neg) if c.loss_type == "sapo" else None,
                                vespo=phi, level=c.importance_sampling_level)
        per_token = out.loss
        n_tok = mask.sum()
        metrics = sampling_gap_metrics(old, b)
        if w is not None:
            if phi is None:
                per_token = per_token * w  # a sequence mode's [B, 1] weight on each of the completion's tokens
            metrics.update(tis_metrics(tis_ratio_values(w, mask, c.tis_mode)))
        if b.ref_logps is not None:
            kl = kl_estimate(logp, b.ref_logps, c.kl_estimator)
            # TRL's use_bias_correction_kl (its default): the KL weighted by the live ratio (at sequence level the
            # completion's one ratio), whose gradient adds kl · ∇log ratio even on-policy, where its value is 1;
            # TRL logs the KL so weighted
            kl = kl * out.ratio if c.use_bias_correction_kl else kl
            per_token = per_token + c.beta * kl
            metrics["kl"] = Metric.mean(kl.detach().masked_fill(~mask, 0).sum(), n_tok)
        loss = aggregate(per_token, mask, c.loss_type, normaliser=global_count,
                         max_completion_length=c.max_completion_length)
        metrics["entropy"] = entropy_metric(out_lp, b)
        # the clip flags: shares of the tokens, or at sequence level (one flag a completion) of the completions
        flags = mask.shape[0] if c.importance_sampling_level == "sequence" else n_tok
        if c.loss_type == "cispo":  # TRL's name for the share of capped weights
            metrics["cispo_clip_ratio"] = Metric.mean(out.is_high_clipped.sum().float(), flags)
        elif phi is not None:  # VESPO's mean sequence weight, TRL's metric
            metrics["vespo/phi_seq_mean"] = Metric.mean(phi.sum(), phi.shape[0])
        elif c.loss_type != "sapo":  # (SAPO's gate clips nothing; TRL logs no ratio for it)
            metrics["clip_ratio/low_mean"] = Metric.mean(out.is_low_clipped.sum().float(), flags)
            metrics["clip_ratio/high_mean"] = Metric.mean(out.is_high_clipped.sum().float(), flags)
            metrics["clip_ratio/region_mean"] = Metric.mean(out.is_region_clipped.sum().float(), flags)
            metrics.update(clip_extremes(out.is_low_clipped, out.is_high_clipped, mask))
        return self.with_router_loss(loss, metrics, router_logits, b)

    def policy_logps(self, model: Any, b: PackedBatch) -> tuple[TargetLogprobs, list[torch.Tensor] | None]:
        """The loss's forward: the completion tokens' log-probs and entropies, and the router's logits when
        a mixture of experts adds its load-balancing loss (None otherwise)."""
        balance = self.router_coef != 0.0 and self.model.training
        with collect_router_logits() if balance else contextlib.nullcontext() as router_logits:
            out_lp = self.token_logps(model, b, entropy=True)
        return out_lp, router_logits if balance else None

    def with_router_loss(self, loss: torch.Tensor, metrics: dict[str, Any], router_logits: list[torch.Tensor] | None,
                         b: PackedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """TRL's `num_tokens`, and the router's load-balancing loss added (`aux_loss`) where there is one."""
        metrics["num_tokens"] = Metric.cumulative(float(b.input_ids.numel()))
        if router_logits:
            cfg = self.model.config
            aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, b.token_weights)
            loss = loss + self.router_coef * aux / (self.config.gradient_accumulation_steps * self.dist.world_size)
            metrics["aux_loss"] = Metric.mean(aux.detach())
        return loss, metrics

    def step_metrics(self, step: int) -> dict[str, Any]:
        m = self.rollout_metrics()
        if self.config.dynamic_sampling:
            assert self.rollout is not None
            m["dynamic_sampling/rounds"] = Metric.mean(float(self.rollout.rounds))
        return m

    def rollout_metrics(self) -> dict[str, Any]:
        """TRL's metrics of the step's rollout: rewards, their spread, completion lengths; and the engine's."""
        r = self.rollout
        assert r is not None
        totals = r.total_rewards.view(-1, r.num_generations)  # [P, G]
        lengths = r.lengths.to(torch.float64)
        truncated = r.truncated.to(torch.float64)
        finite = torch.nan_to_num(totals, nan=0.0)
        # a group with fewer than two scored completions (nanstd NaN) counts as zero-std: no signal in it
        std = torch.nan_to_num(nanstd(totals, dim=1), nan=0.0)
        m: dict[str, Any] = {
            "reward": Metric.mean(finite.sum(), (~totals.isnan()).sum()),
            "frac_reward_zero_std": Metric.mean(float((std < 1e-6).sum()), r.num_prompts),
            "completions/mean_length": Metric.mean(lengths.sum(), lengths.numel()),
            "completions/min_length": Metric.min(lengths.min()),
            "completions/max_length": Metric.max(lengths.max()),
            "completions/clipped_ratio": Metric.mean(truncated.sum(), truncated.numel()),
            # every generated token, dropped groups' too: the engine's speed, not the batch's yield
            "rollout/tokens_per_second": Metric.mean(r.sampled_tokens / max(r.seconds, 1e-9)),
            "rollout/seconds": Metric.mean(r.seconds),
            "rollout/prefix_blocks_shared": Metric.sum(float(r.prefix_blocks_shared)),
            "rollout/sampled_completions": Metric.sum(float(r.sampled_completions)),
        }
        # TRL 1.16's: the std of the whole batch's rewards, every rank's (an all-reduce: every rank is here)
        stds = _batch_stds([totals.flatten(), *(r.rewards[:, f] for f in range(len(self.reward_funcs)))], self.dist)
        m["reward_std"] = Metric.mean(stds[0])
        for f, (name, _) in enumerate(self.reward_funcs):
            col = r.rewards[:, f]
            ok = ~col.isnan()
            m[f"rewards/{name}/mean"] = Metric.mean(col[ok].sum(), ok.sum())
            m[f"rewards/{name}/std"] = Metric.mean(stds[1 + f])
        return m

    def completion_values(self) -> dict[str, torch.Tensor]:
        assert self.rollout is not None
        return {"advantage": self.rollout.advantages}

    def summary_lines(self) -> list[str]:
        c = self.config
        frozen = "the base model (adapters off)" if self.base_is_reference else "a frozen reference"
        ref = f"KL to {frozen} (beta={c.beta}, {c.kl_estimator})" if c.beta > 0 else "no reference model"
        return [
            f"grpo: {self.prompts_per_step} prompts × G={c.num_generations} completions per rank per step, "
            f"{c.max_completion_length} tokens max, temperature {c.temperature}",
            f"grpo: loss_type={c.loss_type}, scale_rewards={c.scale_rewards}, epsilon={c.epsilon}"
            f"/{c.epsilon_high or c.epsilon}, {c.importance_sampling_level}-level ratios, "
            f"num_iterations={c.num_iterations}, {ref}, {tis_line(c)}",
            f"grpo: rewards {', '.join(n for n, _ in self.reward_funcs)}; {len(self.eval_rows)} held-out prompts",
            f"grpo: {self.rollout_line()}",
        ] + loss_warnings(c)


def sampling_gap_metrics(old: torch.Tensor, b: PackedBatch) -> dict[str, Any]:
    """How far the engine's sampled log-probs lie from the trainer's before the update (pagedrl's
    `sampling/sampling_logp_difference/mean` and `/max`, TRL's names for the vLLM gap)."""
    diff = (old - b.sampling_logps).abs().masked_fill(~b.mask, 0.0)
    return {"sampling/sampling_logp_difference/mean": Metric.mean(diff.sum(), b.mask.sum()),
            "sampling/sampling_logp_difference/max": Metric.max(diff.max())}


def clip_extremes(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """TRL's `clip_ratio/low_min` and `/high_max`: the least (greatest) share of a completion's tokens clipped
    (its one flag at sequence level, or RLOO's [B]) in this micro-batch, over every rank's completions, then
    averaged over the micro-batches (`Metric.micro_min`). A completion with no token left is skipped (NaN),
    as TRL's `nanmin` skips it; NaN where the micro-batch has none, as in TRL."""
    def per_completion(flags: torch.Tensor) -> torch.Tensor:
        if flags.dim() == 1 or flags.shape[1] == 1:
            return flags.reshape(-1).double()
        return (flags.double() * mask).sum(-1) / mask.sum(-1)

    lo, hi = per_completion(low), per_completion(high)
    least = torch.where(lo.isnan(), math.inf, lo).min() if lo.numel() else lo.new_tensor(math.inf)
    most = torch.where(hi.isnan(), -math.inf, hi).max() if hi.numel() else hi.new_tensor(-math.inf)
    return {"clip_ratio/low_min": Metric.micro_min(torch.where(least.isinf(), math.nan, least)),
            "clip_ratio/high_max": Metric.micro_max(torch.where(most.isinf(), math.nan, most))}


def entropy_metric(out_lp: TargetLogprobs, b: PackedBatch) -> Metric:
    """TRL's `entropy`: the policy's mean entropy over the completion tokens."""
    assert out_lp.entropy is not None
    return Metric.mean(b.to_padded(out_lp.entropy).masked_fill(~b.mask, 0).sum(), b.mask.sum())


def tis_line(c: GRPOConfig) -> str:
    """The rollout's importance-sampling correction in the start-up lines."""
    if not c.tis_correction:
        return "no rollout importance weights"
    return f"rollout importance weights {c.tis_mode} in [{c.tis_min or 0}, {c.tis_cap or 'inf'}]"


def tis_metrics(values: torch.Tensor) -> dict[str, Metric]:
    """TRL's `sampling/importance_sampling_ratio/min`, `/mean` and `/max` of the rollout's weights (each
    completion's under a sequence mode, each token's otherwise; `tis_ratio_values`), over the step's
    micro-batches and ranks. A micro-batch with none (every token masked out) still names all three, as
    every rank must, and changes none."""
    inf = values.new_tensor(math.inf)
    empty = values.numel() == 0
    return {"sampling/importance_sampling_ratio/min": Metric.min(inf if empty else values.min()),
            "sampling/importance_sampling_ratio/mean": Metric.mean(values.sum(), values.numel()),
            "sampling/importance_sampling_ratio/max": Metric.max(-inf if empty else values.max())}


def loss_warnings(c: GRPOConfig) -> list[str]:
    """Start-up lines for the settings TRL's GRPOTrainer takes but warns about (pagedrl trains them as TRL
    does): a user who copied a recipe learns at once that a loss does not do what its paper did."""
    eps_high = c.epsilon_high or c.epsilon
    lines = [f"cispo caps every importance weight at epsilon_high={eps_high}, below 1, so the gradient of every "
             "token with a positive advantage shrinks by that factor (as in TRL; TRL recommends epsilon_high: 5.0)"
             ] if c.loss_type == "cispo" and eps_high < 1 else []
    sequence = c.importance_sampling_level == "sequence"
    if c.loss_type == "luspo" and not sequence:
        lines.append("luspo with importance_sampling_level token: its paper's setup, as TRL warns, is sequence")
    if c.loss_type == "vespo" and sequence:
        lines.append("vespo weighs each completion by its own sequence ratio; importance_sampling_level sequence "
                     "changes only the KL term's bias-correction weight (TRL warns: set token, its default)")
    if sequence and c.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        lines.append(f"importance_sampling_level sequence with loss_type {c.loss_type}: the {c.loss_type} loss sums "
                     "per-token contributions, so each completion weighs by its length instead of the per-sequence "
                     "objective; GSPO's setup is loss_type grpo (as TRL warns)")
    return [f"grpo: {line}" for line in lines]


def run_grpo(config: GRPOConfig, progress: bool = True) -> Path:
    """Train `config.model` with GRPO; returns `output_dir/final`."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, "GRPO needs")
    algorithm = GRPO(config, loaded.model, loaded.tokenizer, dist, eos_token_ids=loaded.eos_token_ids,
                     generation_config=loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()




def _batch_stds(columns: Sequence[torch.Tensor], dist: DistInfo) -> list[float]:
    """Each column's standard deviation (Bessel's, NaN left out, 0 for fewer than two values) over the
    whole batch, every rank's share of it: TRL's `nanstd` of the gathered rewards, from one all-reduce of
    the counts, sums and sums of squares (in float64), so two processes log what one does."""
    parts = []
    for col in columns:
        kept = col[~col.isnan()].to(torch.float64)
        parts += [float(kept.numel()), float(kept.sum()), float((kept * kept).sum())]
    sums = all_reduce_sum(parts, dist).tolist()
    stds = []
    for n, total, squares in zip(sums[0::3], sums[1::3], sums[2::3], strict=True):
        variance = (squares - total * total / n) / (n - 1) if n > 1 else 0.0
        stds.append(math.sqrt(max(variance, 0.0)))
    return stds
