"""GRPO (Shao et al. 2024) with DAPO's and Dr. GRPO's options, on the one trainer loop.

Each rollout: the in-process engine samples G completions per prompt from the policy's own
tensors, verifiers score them, and each completion's advantage is its reward against its group's
mean (and std). The loss is the clipped surrogate on the completion tokens, optionally with a KL
to a frozen reference, aggregated as `loss_type` says over the whole step's global batch.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampler import processed_logprobs
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import Algorithm, EpochStream, Metric
from pagedrl.train.arithmetic import ArithmeticTask
from pagedrl.train.config import GRPOConfig
from pagedrl.train.distributed import DistInfo
from pagedrl.train.grpo_batch import GRPOBatch, collate_grpo, split_units
from pagedrl.train.losses import aggregate, clipped_surrogate, entropy_from_logits, kl_estimate, tis_weight
from pagedrl.train.rewards import RewardFunc, completion_text, load_reward_function, score
from pagedrl.train.rollout import Rollout, collect_rollout

TOKEN_MEAN_LOSSES = ("dapo", "bnpo")


class PromptSource:
    """Prompts in order: the arithmetic task's endless training stream, or a JSONL file's rows
    epoch after epoch. Its position is one integer, so a checkpoint can resume it exactly."""

    def __init__(self, config: GRPOConfig, dist: DistInfo) -> None:
        self.consumed = 0
        self.task: ArithmeticTask | None = None
        self.rows: list[dict[str, Any]] = []
        if config.dataset == "arithmetic":
            self.task = ArithmeticTask(tuple(config.task_operations), config.task_low, config.task_high,
                                       config.task_num_eval, seed=config.seed)
            self._stream: Iterator[dict[str, Any]] = self.task.train_rows()
        else:
            if config.dataset is None:
                raise ValueError("dataset: GRPO needs prompts: a JSONL path or 'arithmetic'")
            self.rows = read_prompt_rows(config.dataset)
            self.order = EpochStream(len(self.rows), config.seed)
        self.rank, self.world = dist.rank, dist.world_size

    def take(self, n: int) -> list[dict[str, Any]]:
        """This rank's share of the next n × world prompts."""
        if self.task is not None:
            rows = list(itertools.islice(self._stream, n * self.world))
        else:
            rows = [self.rows[i] for i in self.order.take(n * self.world)]
        self.consumed += n * self.world
        return rows[self.rank * n:(self.rank + 1) * n]

    def eval_rows(self, eval_dataset: str | None) -> list[dict[str, Any]]:
        if eval_dataset is not None:
            return read_prompt_rows(eval_dataset)
        return self.task.eval_rows() if self.task is not None else []

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        target = int(state["consumed"])
        while self.consumed < target:  # replay the stream: cheap, and exact
            self.take(1) if self.world == 1 else self.take(max(1, (target - self.consumed) // self.world))


def read_prompt_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset: {path}: file not found")
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{path}:{line_no}: row has no 'prompt' field")
        if not isinstance(row["prompt"], (str, list)) or not row["prompt"]:
            raise ValueError(f"{path}:{line_no}: field 'prompt' must be a non-empty string or list of messages")
        rows.append(row)
    if not rows:
        raise ValueError(f"dataset: {path}: no rows")
    return rows


class GRPO(Algorithm):
    name = "grpo"

    def __init__(self, config: GRPOConfig, model: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 eos_token_ids: list[int] | None = None, reward_funcs: Sequence[tuple[str, RewardFunc]] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        self.config, self.model, self.tokenizer, self.dist = config, model, tokenizer, dist
        self.generation_config = generation_config
        G = config.num_generations
        completions_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        if completions_per_step % G:
            raise ValueError(f"per_device_train_batch_size × gradient_accumulation_steps ({completions_per_step}) "
                             f"must be a multiple of num_generations ({G})")
        self.prompts_per_step = completions_per_step // G  # per rank
        self.examples_per_step = self.prompts_per_step * dist.world_size
        self.normaliser = "completion tokens" if config.loss_type in TOKEN_MEAN_LOSSES else "completions"
        self.source = PromptSource(config, dist)
        if reward_funcs is None:
            specs = config.reward_funcs or (["last_integer_match"] if self.source.task else [])
            if not specs:
                raise ValueError("reward_funcs: none given; name built-ins or 'file.py:function'")
            reward_funcs = [load_reward_function(s, max_completion_length=config.max_completion_length,
                                                 format_pattern=config.format_pattern,
                                                 overlong_buffer=config.overlong_buffer) for s in specs]
        self.reward_funcs = list(reward_funcs)
        self.eval_rows = self.source.eval_rows(config.eval_dataset)
        # The engine runs on the policy's parameters themselves: no copy, no sync; under the trainer's
        # bf16 autocast when it trains under one, so rollouts are drawn from the numbers training computes.
        bf16 = config.use_bf16(next(model.parameters()).device)
        self.llm = LLM.from_module(model, tokenizer, eos_token_ids=eos_token_ids,
                                   kv_cache_tokens=config.kv_cache_tokens or rollout_kv_tokens(config, self.prompts_per_step),
                                   seed=config.seed,
                                   max_num_seqs=max(256, completions_per_step),
                                   autocast_dtype=torch.bfloat16 if bf16 else None)
        self.sampling = SamplingParams(n=G, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                       min_p=config.min_p or 0.0, max_tokens=config.max_completion_length,
                                       seed=None)
        self.ref_model = None
        if config.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.rollout: Rollout | None = None
        self.batches: list[GRPOBatch] = []

    # -- prompts and rollouts -------------------------------------------------------------------

    def encode(self, row: Mapping[str, Any]) -> list[int]:
        from pagedrl.train.tokenization import tokenize_prompt

        ids = tokenize_prompt(self.tokenizer, row["prompt"])
        limit = self.config.max_prompt_length
        if limit is not None and len(ids) > limit:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_length={limit}: {row['prompt']!r:.200}")
        return ids

    def step_batches(self, step: int) -> list[GRPOBatch]:
        if (step - 1) % self.config.num_iterations == 0:
            self.llm.engine.sampler.generator.manual_seed(self.config.seed * 1_000_003 + step)
            self.rollout = collect_rollout(
                self.llm, self.source.take, self.encode, self.prompts_per_step, self.sampling, self.reward_funcs,
                self.config.reward_weights, self.config.scale_rewards, self.config.dynamic_sampling)
            units = split_units(self.rollout.groups, self.config.gradient_accumulation_steps)
            device = next(self.model.parameters()).device
            self.batches = [collate_grpo(u, device, self.config.mask_truncated_completions) for u in units]
            if self.config.num_iterations > 1:
                self.remember_old_logps()
        return self.batches

    @torch.no_grad()
    def remember_old_logps(self) -> None:
        """μ > 1 updates reuse one rollout: the ratio is taken against the policy before the first."""
        for b in self.batches:
            b.old_logps = b.to_padded(self.token_logps(self.model, b)[0])

    def token_logps(self, model: Any, b: GRPOBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] processed log-probs of the completion tokens (the distribution they were sampled
        from: temperature, top-k/top-p/min-p) and the [N, V] logits they came from."""
        hidden = model(b.input_ids, positions=b.positions, meta=b.meta)
        logits = model.logits(hidden[0].index_select(0, b.predict_at))
        c = self.config
        return processed_logprobs(logits, b.targets, c.temperature, c.top_k, c.top_p, c.min_p or 0.0), logits

    # -- the loss --------------------------------------------------------------------------------

    def count(self, batch: GRPOBatch) -> float:
        if self.config.loss_type in TOKEN_MEAN_LOSSES:
            return float(batch.mask.sum())
        return float(batch.num_sequences)

    def loss(self, model: Any, b: GRPOBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        flat, logits = self.token_logps(model, b)
        logp = b.to_padded(flat)
        old = b.old_logps if b.old_logps is not None else logp.detach()
        out = clipped_surrogate(logp, old, b.advantages, b.mask, c.epsilon, c.epsilon_high, c.delta)
        per_token = out.loss
        mask = b.mask
        n_tok = mask.sum()
        metrics: dict[str, Any] = {}
        diff = (old - b.sampling_logps).abs().masked_fill(~mask, 0.0)
        metrics["sampling/sampling_logp_difference/mean"] = Metric.mean(diff.sum(), n_tok)
        metrics["sampling/sampling_logp_difference/max"] = Metric.max(diff.max())
        if c.tis_cap is not None:
            w = tis_weight(old, b.sampling_logps, c.tis_cap)
            per_token = per_token * w
            metrics["sampling/importance_sampling_ratio/mean"] = Metric.mean(w.masked_fill(~mask, 0).sum(), n_tok)
            metrics["sampling/importance_sampling_ratio/min"] = Metric.min(w.masked_fill(~mask, float("inf")).min())
        if self.ref_model is not None:
            with torch.no_grad():
                ref = b.to_padded(self.token_logps(self.ref_model, b)[0])
            kl = kl_estimate(logp, ref, c.kl_estimator)
            per_token = per_token + c.beta * kl
            metrics["kl"] = Metric.mean(kl.detach().masked_fill(~mask, 0).sum(), n_tok)
        loss = aggregate(per_token, mask, c.loss_type, normaliser=global_count,
                         max_completion_length=c.max_completion_length)
        with torch.no_grad():
            temp = logits / c.temperature
            ent = b.to_padded(entropy_from_logits(temp)).masked_fill(~mask, 0)
        metrics["entropy"] = Metric.mean(ent.sum(), n_tok)
        metrics["clip_ratio/low_mean"] = Metric.mean(out.is_low_clipped.sum().float(), n_tok)
        metrics["clip_ratio/high_mean"] = Metric.mean(out.is_high_clipped.sum().float(), n_tok)
        metrics["clip_ratio/region_mean"] = Metric.mean(out.is_region_clipped.sum().float(), n_tok)
        metrics["num_tokens"] = Metric.cumulative(float(b.input_ids.numel()))
        return loss, metrics

    def step_metrics(self, step: int) -> dict[str, Any]:
        r = self.rollout
        assert r is not None
        groups = r.groups
        totals = torch.stack([g.total_rewards for g in groups])  # [P, G]
        lengths = torch.tensor([len(cids) for g in groups for cids in g.completion_ids], dtype=torch.float64)
        truncated = torch.tensor([t for g in groups for t in g.truncated], dtype=torch.float64)
        finite = torch.nan_to_num(totals, nan=0.0)
        std = torch.stack([t[~t.isnan()].std() if (~t.isnan()).sum() > 1 else t.new_zeros(()) for t in totals])
        m: dict[str, Any] = {
            "reward": Metric.mean(finite.sum(), (~totals.isnan()).sum()),
            "reward_std": Metric.mean(std.sum(), len(groups)),
            "frac_reward_zero_std": Metric.mean(float((std < 1e-6).sum()), len(groups)),
            "completions/mean_length": Metric.mean(lengths.sum(), lengths.numel()),
            "completions/min_length": Metric.min(lengths.min()),
            "completions/max_length": Metric.max(lengths.max()),
            "completions/clipped_ratio": Metric.mean(truncated.sum(), truncated.numel()),
            "rollout/tokens_per_second": Metric.mean(r.generated_tokens / max(r.seconds, 1e-9)),
            "rollout/seconds": Metric.mean(r.seconds),
            "rollout/prefix_blocks_shared": Metric.sum(float(r.prefix_blocks_shared)),
        }
        for f, (name, _) in enumerate(self.reward_funcs):
            col = torch.cat([g.rewards[:, f] for g in groups])
            ok = ~col.isnan()
            m[f"rewards/{name}/mean"] = Metric.mean(col[ok].sum(), ok.sum())
        if self.config.dynamic_sampling:
            m["dynamic_sampling/rounds"] = Metric.mean(float(r.rounds))
        return m

    def after_optimizer_step(self, step: int) -> None:
        # The weights changed under the engine: no KV computed before this may be reused.
        self.llm.bump_weight_version()

    # -- evaluation, state -----------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float] | None:
        if not self.eval_rows:
            return None
        rows = self.eval_rows[self.dist.rank::self.dist.world_size]
        max_tokens = self.config.eval_max_tokens or self.config.max_completion_length
        acc, mean_reward = evaluate_rows(self.llm, rows, self.encode, self.reward_funcs[0], max_tokens)
        self.llm.sleep()
        return {"accuracy": acc, "reward": mean_reward}

    @property
    def epoch(self) -> float:
        return self.source.consumed / len(self.source.rows) if self.source.rows else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state["prompts"])

    def summary_lines(self) -> list[str]:
        c = self.config
        ref = f"KL to a frozen reference (beta={c.beta}, {c.kl_estimator})" if c.beta > 0 else "no reference model"
        return [
            f"grpo: {self.prompts_per_step} prompts × G={c.num_generations} completions per rank per step, "
            f"{c.max_completion_length} tokens max, temperature {c.temperature}",
            f"grpo: loss_type={c.loss_type}, scale_rewards={c.scale_rewards}, epsilon={c.epsilon}"
            f"/{c.epsilon_high or c.epsilon}, num_iterations={c.num_iterations}, {ref}",
            f"grpo: rewards {', '.join(n for n, _ in self.reward_funcs)}; {len(self.eval_rows)} held-out prompts",
        ]


def evaluate_rows(llm: LLM, rows: Sequence[Mapping[str, Any]], encode, reward: tuple[str, RewardFunc],
                  max_tokens: int) -> tuple[float, float]:
    """Greedy completions for every row, scored by `reward`: (share scoring 1, mean score)."""
    outs = llm.generate([encode(r) for r in rows], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    prompts = [r["prompt"] for r in rows]
    texts = [o.outputs[0].text for o in outs]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts,
                                                                                                   strict=True)]
    columns: dict[str, list[Any]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "prompt":
                columns.setdefault(k, []).append(v)
    values = [row[0] for row in score([reward], prompts, completions,
                                      [o.outputs[0].token_ids for o in outs], columns)]
    scored = [v for v in values if v == v]  # NaN: not applicable
    if not scored:
        return float("nan"), float("nan")
    return sum(1.0 for v in scored if v >= 1.0) / len(scored), sum(scored) / len(scored)


def rollout_kv_tokens(config: GRPOConfig, prompts_per_step: int, block_size: int = 16) -> int:
    """The KV budget that holds one step's rollout at once: each prompt once (its blocks are shared by
    the group) and each completion with a block of slack for the copied partial prompt block. Sized
    to the step, not to the host, so the engine holds no memory the rollout does not use."""
    prompt = config.max_prompt_length or 512
    completions = prompts_per_step * config.num_generations
    return prompts_per_step * prompt + completions * (config.max_completion_length + block_size)


def run_grpo(config: GRPOConfig, progress: bool = True) -> Path:
    """Train `config.model` with GRPO; returns `output_dir/final`."""
    from pagedrl.train.trainer import Trainer, start_run

    dist, loaded = start_run(config, "GRPO needs")
    algorithm = GRPO(config, loaded.model, loaded.tokenizer, dist, eos_token_ids=loaded.eos_token_ids,
                     generation_config=loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()


__all__ = ["GRPO", "run_grpo", "evaluate_rows", "completion_text"]
