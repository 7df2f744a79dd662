"""RLHF with PPO (Ouyang et al. 2022; Ziegler et al. 2019), four roles in one process, on the one
trainer loop.

Each rollout: the in-process engine samples from the policy's own tensors; then, once per rollout
and in the packed layout GRPO trains in (each prompt once, its completions after it), a no-grad
pass (`ppo_rollout.py`) computes what stays fixed while the rollout is trained on: the policy's
log-probs (the ratio's denominator, under the rollout's own sampling params), the frozen
reference's (for the KL penalty), the critic's values and the reward model's score at each
completion's last token.
Per-token rewards are −kl_coef·KL plus the score at the last token; GAE turns them into
advantages (whitened over the rollout) and returns. The rollout is then trained on for
`num_ppo_epochs` epochs of `num_mini_batches` optimizer steps: the clipped surrogate for the
policy plus `vf_coef` times the clipped value loss, token means over the mini-batch.

The first epoch walks the completions in the order the fixed pass packed them, so the first
mini-batch's forward is the same computation on the same weights: its ratio is exactly 1.
Later epochs shuffle whole groups (a prompt's completions stay together, so its prompt is still
computed once).

Under torchrun each rank samples and scores its share of the prompts with its own engine and
trains on it (a mini-batch is each rank's share of it, as in TRL); what is a statistic of the
batch is taken over every rank's completions: advantage and reward whitening, the adaptive KL
coefficient's mean KL, the logged `objective/*` metrics. The frozen reference and reward model are
replicated on every rank; the critic trains, so FSDP2 shards it with the policy.

With LoRA (`use_peft`) the policy trains adapters on its frozen base, the reference is that base
with the adapters off (no copy), and the critic trains its own adapter and head (`critic.lora_critic`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.adapter import load_adapter_weights, write_adapter
from pagedrl.model.checkpoint import load_weights, read_state_dict, save_checkpoint
from pagedrl.model.heads import SequenceScorer
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import uses_lora
from pagedrl.train.algorithms.ppo_rollout import RolloutTensors, rollout_tensors
from pagedrl.train.distributed import DistInfo, all_reduce_sum
from pagedrl.train.logprobs import logprobs_from_hidden
from pagedrl.train.losses import clipped_surrogate, clipped_value_loss
from pagedrl.train.metrics import Metric
from pagedrl.train.rl.advantages import explained_variance, ppo_targets
from pagedrl.train.rl.config import PPOConfig
from pagedrl.train.rl.critic import ActorCritic, load_critic, lora_critic, substate
from pagedrl.train.rl.kl_control import AdaptiveKLController, KLController
from pagedrl.train.rl.online import OnlineAlgorithm
from pagedrl.train.rl.packing import PackedBatch, pack, split_units
from pagedrl.train.rl.reward_model import load_reward_model
from pagedrl.train.rl.rewards import RewardFunc
from pagedrl.train.rl.rollout import Rollout, sample, score_rollout

LOG_RATIO_CLAMP = 20.0  # |log π − log π_ref| beyond this is numerical, not drift


class PPO(OnlineAlgorithm):
    name = "ppo"
    normaliser = "completion tokens"
    config: PPOConfig

    def __init__(self, config: PPOConfig, policy: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 critic: SequenceScorer | None = None, reward_model: SequenceScorer | None = None,
                 eos_token_ids: list[int] | None = None, reward_funcs: list[tuple[str, RewardFunc]] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        self.mini_batch = config.per_device_train_batch_size * config.gradient_accumulation_steps
        completions = self.mini_batch * config.num_mini_batches
        super().__init__(config, policy, tokenizer, dist, completions // config.num_generations, eos_token_ids,
                         reward_funcs, generation_config, needs_reward_funcs=reward_model is None)
        self.steps_per_rollout = config.num_ppo_epochs * config.num_mini_batches
        self.examples_per_step = self.mini_batch * dist.world_size  # completions trained on per step
        self.model = ActorCritic(policy, critic)
        self.reward_model = reward_model.eval().requires_grad_(False) if reward_model is not None else None
        # With LoRA the reference is the base: the policy with its adapters switched off, no copy.
        self.base_is_reference = config.kl_coef > 0 and uses_lora(policy)
        self.ref_model = (copy.deepcopy(policy).eval().requires_grad_(False)
                          if config.kl_coef > 0 and not self.base_is_reference else None)
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
                       if config.kl_target is not None else KLController(config.kl_coef))
        self.find_unused_parameters = config.critic_warmup_steps > 0
        self.data: RolloutTensors | None = None
        self._packed: tuple[Rollout, int, list[list[PackedBatch]]] | None = None  # one epoch's batches
        self.rollout_metrics: dict[str, Any] = {}
        self.step = 0

    # -- rollouts ---------------------------------------------------------------------------------

    def step_batches(self, step: int) -> list[PackedBatch]:
        self.step = step
        m = (step - 1) % self.steps_per_rollout
        if m == 0 or self.data is None:
            with self.full_weights():  # sharded: the engine and the no-grad passes see whole weights
                self.collect(step - m)
        epoch, j = divmod(m, self.config.num_mini_batches)
        batches = self.micro_batches(epoch, (step - 1) // self.steps_per_rollout)[j]
        self.model.detach_shared = self.warming_up(step)
        return [self.attach(b) for b in batches]

    def warming_up(self, step: int) -> bool:
        return step <= self.config.critic_warmup_steps

    def micro_batches(self, epoch: int, rollout_index: int) -> list[list[PackedBatch]]:
        """The rollout cut into mini-batches of micro-batches for one epoch. Epoch 0 keeps the
        sampled order; later ones shuffle whole groups with a generator seeded by the run's seed,
        the rollout and the epoch (so a resumed run shuffles the same way). Packed once per epoch
        and kept while its mini-batches are handed out."""
        assert self.rollout is not None
        if self._packed is not None and self._packed[0] is self.rollout and self._packed[1] == epoch:
            return self._packed[2]
        r, G = self.rollout, self.config.num_generations
        prompts = list(range(r.num_prompts))
        if epoch > 0:
            g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + rollout_index * 1009 + epoch)
            prompts = torch.randperm(r.num_prompts, generator=g).tolist()
        order = [p * G + k for p in prompts for k in range(G)]
        device = next(self.policy.parameters()).device
        out = []
        for j in range(self.config.num_mini_batches):
            chunk = order[j * self.mini_batch:(j + 1) * self.mini_batch]
            units = split_units(r, self.config.gradient_accumulation_steps, chunk)
            out.append([pack(r, u, device) for u in units])
        self._packed = (self.rollout, epoch, out)
        return out

    def attach(self, b: PackedBatch) -> PackedBatch:
        """The rollout's fixed per-token tensors for the completions of `b`."""
        d = self.data
        assert d is not None
        L = b.mask.shape[1]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[b.completion_index, :L]

        b.old_logps, b.ref_logps, b.old_values = take(d.old_logps), take(d.ref_logps), take(d.old_values)
        b.advantages, b.returns = take(d.advantages), take(d.returns)
        return b

    @torch.no_grad()
    def collect(self, step: int) -> None:
        """Sample a rollout and compute everything that stays fixed while it is trained on."""
        c = self.config
        rows, seeds = self.next_prompts(self.prompts_per_rollout * self.dist.world_size)
        rollout = sample(self.llm, rows, self.sampling, seeds)
        self.llm.sleep()  # the training passes run next: the KV cache gives its memory back
        if self.reward_funcs:
            score_rollout(rollout, self.reward_funcs, c.reward_weights)
        self.rollout = rollout
        if bool((rollout.lengths == 0).any()):
            raise ValueError(f"step {step}: the engine returned an empty completion; PPO needs at least one token")
        reference = self.ref_model if self.ref_model is not None else self.policy if self.base_is_reference else None
        batches = (b for mini in self.micro_batches(0, 0) for b in mini)
        self.data = rollout_tensors(rollout, batches, self.model, reference, self.reward_model, self.sampling, self.bf16)
        self.shape_rewards(step, rollout, self.data)

    @torch.no_grad()
    def shape_rewards(self, step: int, rollout: Rollout, d: RolloutTensors) -> None:
        """Scores → per-token rewards → GAE advantages and returns, and the rollout's metrics."""
        c = self.config
        bad = int(all_reduce_sum([float((~torch.isfinite(d.scores)).sum())], self.dist)[0])  # every rank stops
        if bad:
            raise ValueError(f"step {step}: {bad} reward score(s) are NaN or infinite (a reward function without an "
                             "answer for a completion, or a diverged reward model); stopping before the update "
                             "(the last checkpoint is intact)")
        mask = d.mask
        raw_scores = d.scores.clone()
        truncated = rollout.truncated.to(d.scores.device)
        has_ref = self.ref_model is not None or self.base_is_reference
        t = ppo_targets(d.scores, ~truncated, d.old_logps, d.ref_logps if has_ref else None,
                        d.old_values, mask, self.kl_ctl.value, c.kl_estimator, c.missing_eos_penalty,
                        c.reward_clip_range, c.whiten_rewards, c.gamma, c.lam, LOG_RATIO_CLAMP, self.sum_across)
        values = d.old_values.masked_fill(~mask, 0.0)
        d.scores, d.rewards, d.advantages, d.returns, d.old_values = t.scores, t.rewards, t.advantages, t.returns, values
        kl, non_score, returns = t.kl, t.non_score_rewards, t.returns
        seq_kl = kl.sum(1)
        sampling = torch.zeros_like(d.old_logps)
        for i, lp in enumerate(rollout.sampling_logps):
            sampling[i, :len(lp)] = torch.tensor(lp, dtype=sampling.dtype)
        diff = (d.old_logps - sampling).abs().masked_fill(~mask, 0.0)
        # Batch statistics over every rank's completions (each rank logs the same global values).
        n, scores_sum, kl_sum, entropy_sum, non_score_sum, shaped_sum, eos, length_sum, clipped, diff_sum, n_tok = \
            self.sum_across(torch.stack([torch.tensor(float(len(rollout))), raw_scores.sum(), seq_kl.sum(),
                                         (-d.old_logps * mask).sum(), non_score.sum(), d.scores.sum(),
                                         (~truncated).sum(), mask.sum(), truncated.sum(), diff.sum(),
                                         mask.sum()]).cpu().double()).tolist()
        self.rollout_metrics = {
            "objective/scores": Metric.mean(scores_sum / n),
            "objective/kl": Metric.mean(kl_sum / n),
            "objective/entropy": Metric.mean(entropy_sum / n),
            "objective/non_score_reward": Metric.mean(non_score_sum / n),
            "objective/rlhf_reward": Metric.mean((non_score_sum + shaped_sum) / n),
            "objective/kl_coef": Metric.mean(self.kl_ctl.value),
            "val/num_eos_tokens": Metric.mean(eos),
            "critic/vf_explained_var": Metric.mean(explained_variance(values, returns, mask, self.sum_across)),
            "completions/mean_length": Metric.mean(length_sum / n),
            "completions/clipped_ratio": Metric.mean(clipped / n),
            "sampling/sampling_logp_difference/mean": Metric.mean(diff_sum / n_tok),
            "sampling/sampling_logp_difference/max": Metric.max(float(diff.max())),
            "rollout/seconds": Metric.mean(rollout.seconds),
            "rollout/tokens_per_second": Metric.mean(rollout.generated_tokens / max(rollout.seconds, 1e-9)),
            "rollout/prefix_blocks_shared": Metric.mean(float(rollout.prefix_blocks_shared)),
        }
        for f, (name, _) in enumerate(self.reward_funcs):
            col = rollout.rewards[:, f]
            ok = ~col.isnan()
            self.rollout_metrics[f"rewards/{name}/mean"] = Metric.mean(float(col[ok].sum()), float(ok.sum()))
        self.kl_ctl.update(kl_sum / n, int(n))  # the mean KL of the whole batch

    def sum_across(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (float64, on `t`'s device; the identity in one process)."""
        return all_reduce_sum(t, self.dist).to(t.device)

    # -- the loss -----------------------------------------------------------------------------------

    def count(self, batch: PackedBatch) -> float:
        return float(batch.mask.sum())

    def loss(self, model: Any, b: PackedBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        assert b.old_logps is not None and b.old_values is not None and b.returns is not None
        assert b.advantages is not None
        hidden, value_hidden = model(b.input_ids, positions=b.positions, meta=b.meta)
        out = logprobs_from_hidden(model.logits, hidden, b.predict_at, b.targets, self.sampling, entropy=True)
        flat = value_hidden.reshape(-1, value_hidden.shape[-1]).index_select(0, b.predict_at)
        values = b.to_padded(model.values(flat))
        mask = b.mask
        n_tok = mask.sum()
        value = clipped_value_loss(values, b.old_values, b.returns, mask, c.cliprange_value)
        value_sum = value.loss.sum()
        if not bool(torch.isfinite(value_sum)):
            raise ValueError(f"step {self.step}: the critic's value loss is {float(value_sum)}; stopping before the "
                             "update (the last checkpoint is intact)")
        loss = c.vf_coef * value_sum / global_count
        logp = b.to_padded(out.logps)
        policy = clipped_surrogate(logp, b.old_logps, b.advantages, mask, c.cliprange)
        if not self.warming_up(self.step):
            loss = loss + policy.loss.sum() / global_count
        with torch.no_grad():
            diff = (logp - b.old_logps).masked_fill(~mask, 0.0)
            assert out.entropy is not None
            metrics: dict[str, Any] = {
                "policy/approxkl_avg": Metric.mean(0.5 * (diff ** 2).sum(), n_tok),
                "policy/clipfrac_avg": Metric.mean(policy.is_region_clipped.sum().float(), n_tok),
                "policy/entropy_avg": Metric.mean(out.entropy.sum(), n_tok),
                "loss/policy_avg": Metric.mean(policy.loss.sum(), n_tok),
                "loss/value_avg": Metric.mean(value_sum, n_tok),
                "val/clipfrac_avg": Metric.mean(value.is_clipped.sum().float(), n_tok),
                "val/ratio": Metric.mean(policy.ratio.detach().masked_fill(~mask, 0.0).sum(), n_tok),
                "num_tokens": Metric.cumulative(float(b.input_ids.numel())),
            }
        return loss, metrics

    def step_metrics(self, step: int) -> dict[str, Any]:
        return dict(self.rollout_metrics)

    def completion_values(self) -> dict[str, torch.Tensor]:
        assert self.data is not None
        return {"score": self.data.scores.cpu()}

    # -- checkpoints ----------------------------------------------------------------------------

    def save_model(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The policy in HF layout (ready for `pagedrl serve`), or with LoRA its adapter in PEFT's
        format, and the critic beside it in `critic/` (in the same form); `state` (whole tensors of
        the actor-critic, when sharded) is split between the two."""
        if uses_lora(self.policy):
            write_adapter(self.policy, folder, self.tokenizer)
        else:
            policy_state = None if state is None else substate(state, "policy.")
            save_checkpoint(self.policy, folder, generation_config=self.generation_config, state=policy_state)
            self.tokenizer.save(folder)
        self.model.save_critic(folder, self.tokenizer, state)

    def load_model(self, folder: Path) -> None:
        if uses_lora(self.policy):
            load_adapter_weights(self.policy, folder)
        else:
            state = read_state_dict(folder, dtype=torch.float32)
            with torch.no_grad():
                load_weights(self.policy, state, str(folder))
        self.model.load_critic(folder)

    def state_dict(self) -> dict[str, Any]:
        """Prompts, the KL coefficient and, between rollouts' steps, the rollout being trained on
        (so a run resumed mid-rollout trains on the same samples)."""
        state = super().state_dict()
        state["kl_controller"] = self.kl_ctl.state_dict()
        if self.rollout is not None and self.data is not None:
            state["rollout"] = {"rollout": self.rollout, "data": self.data, "metrics": self.rollout_metrics}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if "rollout" in state:
            device = next(self.policy.parameters()).device
            saved = state["rollout"]
            self.rollout, self.rollout_metrics = saved["rollout"], saved["metrics"]
            d = saved["data"]
            self.data = RolloutTensors(**{k: getattr(d, k).to(device) for k in RolloutTensors.__dataclass_fields__})

    def summary_lines(self) -> list[str]:
        c = self.config
        roles = [("policy", self.policy, "trained; the engine generates with it")]
        if self.base_is_reference:
            roles.append(("reference", self.policy, f"the policy's base, adapters off (no copy); KL {c.kl_estimator}, "
                          f"kl_coef={c.kl_coef}"))
        if self.ref_model is not None:
            roles.append(("reference", self.ref_model, f"frozen; KL {c.kl_estimator}, kl_coef={c.kl_coef}"
                          + (f", adaptive to {c.kl_target}" if c.kl_target is not None else "")))
        if self.reward_model is not None:
            roles.append(("reward model", self.reward_model, f"frozen; {c.reward_model_path}"))
        if self.model.critic is not None:
            roles.append(("critic", self.model.critic, f"trained; value head on its own backbone, from the {c.critic_init}"))
        lines = [f"ppo: {role:12s} {_params(m) / 1e6:8.1f}M parameters {_bytes(m) / 2**20:8.0f} MiB  ({what})"
                 for role, m, what in roles]
        if self.model.critic is None:
            lines.append(f"ppo: critic       shares the policy's backbone (+{self.model.value_head.weight.numel()} "
                         "parameters: its value head)")
        if self.reward_funcs:
            lines.append(f"ppo: rewards from {', '.join(n for n, _ in self.reward_funcs)}")
        lines.append(f"ppo: {self.prompts_per_rollout} prompts × {c.num_generations} per rank per rollout, "
                     f"{c.num_ppo_epochs} epochs × {c.num_mini_batches} mini-batches = {self.steps_per_rollout} "
                     f"optimizer steps per rollout; {c.max_completion_length} tokens max, temperature {c.temperature}")
        lines.append("ppo: forward passes per rollout: policy+critic 1, reference "
                     f"{int(self.ref_model is not None or self.base_is_reference)}, reward model {int(self.reward_model is not None)} (no grad); "
                     "per optimizer step: policy+critic 1 (with grad)")
        lines.append(f"ppo: {self.rollout_line()}")
        return lines


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    return a.backend.get_vocab(with_added_tokens=True) == b.backend.get_vocab(with_added_tokens=True)


def run_ppo(config: PPOConfig, progress: bool = True) -> Path:
    """Train `config.model` with PPO; returns `output_dir/final`."""
    from pagedrl.model.resolve import resolve_model_path
    from pagedrl.train.dither import dither_for_run
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, "PPO needs")
    policy_path = resolve_model_path(config.model, config.revision)
    reward_model = None
    rm_path = resolve_model_path(config.reward_model_path) if config.reward_model_path else None
    for role, path in (("reward_model_path", rm_path), ("critic", policy_path if config.critic_init == "policy" else None)):
        if path is None:
            continue
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{role}: {path} has no tokenizer.json; PPO must check it shares the policy's tokenizer")
        if not same_tokenizer(Tokenizer.from_folder(path), loaded.tokenizer):
            raise ValueError(f"{role}: the tokenizer of {path} differs from the policy's ({policy_path}); PPO scores "
                             "the policy's own token ids, so the reward model and critic must share its tokenizer")
    if rm_path is not None:
        reward_model = load_reward_model(rm_path, device=dist.device, dtype=torch.float32)
    critic = load_critic(config.critic_init, policy_path, rm_path, dist.device, config.seed)
    if critic is not None and config.use_peft:
        from_rm = config.critic_init == "reward_model" and config.reward_model_path is not None
        lora_critic(config, critic, loaded.model, base=str(config.reward_model_path) if from_rm else None)
    dither_for_run(config, dist.device, critic)  # the policy's were dithered in start_run
    algorithm = PPO(config, loaded.model, loaded.tokenizer, dist, critic=critic, reward_model=reward_model,
                    eos_token_ids=loaded.eos_token_ids, generation_config=loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()
