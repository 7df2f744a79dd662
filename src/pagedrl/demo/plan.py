"""What `pagedrl demo` runs: one plan (quick or full) from which every stage's config is built, so
GRPO, DPO and RLHF start from the same model, train on the same task with the same wall-clock
budget, and are evaluated on the same held-out problems with the same greedy engine.

RLHF's budget covers both of its trained models: the reward model gets `rm_share` of it and PPO
the rest, so the three methods spend the same training minutes. Evaluation time is not counted
(the trainers' `max_train_minutes` excludes it), nor is sampling the shared preference pairs,
which DPO and the reward model both use.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedrl.train.config import TrainConfig
from pagedrl.train.offline_config import DPOConfig, RewardConfig
from pagedrl.train.rl.config import GRPOConfig, PPOConfig

CAP = 2.0  # a stage's minutes cap under step budgets, as a multiple of its predicted training minutes


@dataclass
class DemoPlan:
    output_dir: str = "runs/demo"
    model: str = "smollm2-135m-instruct"
    quick: bool = False
    budget_minutes: float = 10.0  # training minutes per method (evaluations excluded)
    seed: int = 0
    # The engine stage's weights (`serve`'s `--quantization`: gguf, int8, int4; None: as the model loads).
    # The alignment stages train and evaluate the float model: their held-out accuracies are compared
    # with the base's, and a base quantized for serving is not what the trainers update.
    quantization: str | None = None
    # Part 1: paged attention. Mixed-length requests (prompt 16-512 and output 16-256 tokens, times
    # `scale`) plus one request sampling `n_samples` completions of one long prompt.
    num_requests: int = 24
    scale: float = 0.25
    n_samples: int = 8
    long_prompt_tokens: int = 256
    n_sample_tokens: int = 32
    hf_batch_size: int = 8
    # The task and held-out evaluation (greedy, with the engine). 64 tokens: the model often works
    # its way to the sum in a sentence, and a shorter cut scores those answers as wrong.
    task_low: int = 10
    task_high: int = 99
    num_eval: int = 256
    completion_tokens: int = 64  # rollouts, pairs and evaluation alike
    # Preference pairs for DPO and the reward model, sampled from the base model as the RLHF recipe
    # samples them: several completions per prompt at a temperature where correct and wrong
    # answers both appear, every correct x wrong pair of a prompt up to a cap.
    pair_prompts: int = 128
    pair_generations: int = 8
    pair_temperature: float = 0.7
    pairs_per_prompt: int = 4
    # Each method's batch, learning rate and evaluations along the way (four to ten per method in
    # the full demo on a 2-core CPU in bf16, a few seconds each), chosen from measured runs
    # (bench/RESULTS.md, "Demo"): GRPO at 4 prompts x G = 8 and 2e-5 is significantly above the
    # base model within half a minute; DPO at 8 pairs a step and 5e-6 within a quarter of a minute.
    grpo_prompts_per_step: int = 4
    num_generations: int = 8
    grpo_eval_steps: int = 16
    dpo_batch_pairs: int = 8
    dpo_eval_steps: int = 25
    rm_share: float = 1 / 4
    ppo_prompts_per_step: int = 4
    ppo_generations: int = 4
    ppo_eval_steps: int = 10
    grpo_learning_rate: float = 2e-5
    # DPO passes over its pairs again and again within a budget: at 5e-6 held-out accuracy peaks
    # near 50 steps of 8 pairs (0.21 -> 0.52 on 256 problems) and falls to 0.31 by 129 (ten minutes),
    # so the full demo's ten minutes take 2e-6 (about the same distance in all) and the quick
    # one's 0.75 minutes 5e-6.
    dpo_learning_rate: float = 2e-6
    # PPO's policy: at 2e-5 it learns to please the reward model's taste for a terse "a + b = c"
    # within ten steps and held-out accuracy falls to 1%; at 1e-5 it rises slowly.
    ppo_learning_rate: float = 1e-5
    # PPO's KL penalty against the reference. At TRL's 0.05 the full demo's policy drifted 10-15
    # nats from the base to please the reward model and held-out accuracy fell 0.21 -> 0.00 by step
    # 20 (at sampling temperature 0.7: up to 0.31 at step 20, then 0.04); at 0.2 the drift stays near
    # 5 nats and accuracy, after a dip, ends at 0.32 (bench/RESULTS.md, "Demo").
    ppo_kl_coef: float = 0.2
    # GRPO's and PPO's sampling temperature. At 1.0 about 3% of the base model's samples are right,
    # so most groups of a 4-prompt step score all zero and teach nothing: over ten minutes that
    # averages out (the full form is measured at 1.0), in the quick form's few steps it decides the
    # run (seed 1: 5 GRPO steps, two with zero gradient, 0.234 -> 0.219). The quick form samples at
    # 0.7, as the pairs are sampled, where about 10% are right.
    rollout_temperature: float = 1.0
    # DAPO's dynamic sampling for GRPO: groups whose samples all score alike are dropped and refilled
    # from the next prompts, so every step learns from four groups with a correct and a wrong
    # answer. Without it the quick form's seed 1 collapsed (0.219 -> 0.008: its few steps with any
    # gradient were each driven by one or two correct samples); with it, 0.469 after 2 steps.
    grpo_dynamic_sampling: bool = False
    rm_batch_pairs: int = 8
    # Step budgets (0: none, the minutes decide). The quick form sets them from a measurement of the
    # machine at start (`demo/calibrate.py`, kept in `calibration`): each method trains for its steps,
    # its minutes capped at twice their prediction, so a slow CPU gets as many steps as a fast one
    # (in more minutes) instead of one or two.
    grpo_max_steps: int = 0
    dpo_max_steps: int = 0
    rm_max_steps: int = 0
    ppo_max_steps: int = 0
    calibration: dict[str, Any] | None = None
    # Warm-up of the online methods' learning rates: GRPO's first steps at 1/3 and 2/3 of its rate,
    # PPO's first at half. At the full rate a first step is Adam's sign step (every weight moves by
    # the learning rate) on one batch of a few correct samples: on an AVX2 CPU in float32 the quick
    # demo's only GRPO step took held-out accuracy from 0.188 to 0.086 (bench/RESULTS.md, "Demo").
    grpo_warmup_steps: int = 2
    ppo_warmup_steps: int = 1
    report_to: tuple[str, ...] = ("jsonl",)

    @classmethod
    def preset(cls, quick: bool, **fields: Any) -> DemoPlan:
        """The full demo (about 40 minutes on a 2-core CPU) or the quick one (about 5): fewer
        requests and problems, no evaluation along the way, a minute per method."""
        base: dict[str, Any] = {}
        if quick:
            base = dict(quick=True, budget_minutes=1.0, num_requests=12, scale=0.15, n_samples=4,
                        long_prompt_tokens=128, n_sample_tokens=16, num_eval=128, pair_prompts=48,
                        dpo_learning_rate=5e-6, rollout_temperature=0.7, grpo_dynamic_sampling=True,
                        ppo_prompts_per_step=4, grpo_eval_steps=10_000, dpo_eval_steps=10_000,
                        ppo_eval_steps=10_000)
        return cls(**{**base, **{k: v for k, v in fields.items() if v is not None}})

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    # -- stage configs -----------------------------------------------------------------------------

    def stage_config(self, stage: str, resume: bool = False) -> TrainConfig:
        """The config of training stage `stage` (grpo, dpo, rm or ppo); `resume` continues from the
        newest checkpoint in its folder (the budget counts the minutes already trained)."""
        config = {"grpo": self.grpo, "dpo": self.dpo, "rm": self.rm, "ppo": self.ppo}[stage]()
        config.resume_from_checkpoint = True if resume else None
        return config

    def _common(self, stage: str, minutes: float, eval_steps: int | None, warmup: int = 0) -> dict[str, Any]:
        steps = getattr(self, f"{stage}_max_steps")
        if steps:  # a step budget, with a minutes cap
            minutes = stage_caps(self)[stage] if self.calibration is not None else CAP * minutes
        return dict(model=self.model, output_dir=str(self.out / stage), seed=self.seed,
                    max_steps=steps or 1_000_000, max_train_minutes=minutes, lr_scheduler_type="constant_with_warmup",
                    warmup_steps=warmup, warmup_starts_at_zero=False, logging_steps=1, save_steps=None,
                    eval_steps=eval_steps, eval_on_start=False, report_to=list(self.report_to))

    def _task(self) -> dict[str, Any]:
        return dict(dataset="arithmetic", task_operations=["+"], task_low=self.task_low, task_high=self.task_high,
                    task_num_eval=self.num_eval, max_completion_length=self.completion_tokens,
                    num_completions_to_print=2)

    def grpo(self) -> GRPOConfig:
        completions = self.grpo_prompts_per_step * self.num_generations
        return GRPOConfig(**self._common("grpo", self.budget_minutes, self.grpo_eval_steps, self.grpo_warmup_steps),
                          **self._task(),
                          num_generations=self.num_generations, per_device_train_batch_size=completions,
                          gradient_accumulation_steps=1, temperature=self.rollout_temperature,
                          learning_rate=self.grpo_learning_rate, dynamic_sampling=self.grpo_dynamic_sampling,
                          beta=0.0, loss_type="dapo", scale_rewards="group")

    def dpo(self) -> DPOConfig:
        return DPOConfig(**self._common("dpo", self.budget_minutes, self.dpo_eval_steps),
                         dataset=str(self.out / "pairs" / "pairs.jsonl"), per_device_train_batch_size=self.dpo_batch_pairs,
                         learning_rate=self.dpo_learning_rate, beta=0.1, loss_type="sigmoid", max_length=256)

    def rm(self) -> RewardConfig:
        return RewardConfig(**self._common("rm", self.budget_minutes * self.rm_share, None),  # no held-out pairs
                            dataset=str(self.out / "pairs" / "pairs.jsonl"), per_device_train_batch_size=self.rm_batch_pairs,
                            learning_rate=2e-5, center_rewards_coefficient=0.01, max_length=256)

    def ppo(self) -> PPOConfig:
        completions = self.ppo_prompts_per_step * self.ppo_generations
        return PPOConfig(**self._common("ppo", self.budget_minutes * (1 - self.rm_share), self.ppo_eval_steps,
                                         self.ppo_warmup_steps),
                         **self._task(), num_generations=self.ppo_generations,
                         per_device_train_batch_size=completions, gradient_accumulation_steps=1, num_mini_batches=1,
                         num_ppo_epochs=1, temperature=self.rollout_temperature,
                         learning_rate=self.ppo_learning_rate, kl_coef=self.ppo_kl_coef,
                         missing_eos_penalty=1.0, reward_model_path=str(self.out / "rm" / "final"))


def stage_caps(plan: DemoPlan) -> dict[str, float]:
    """Each trained stage's minutes cap under step budgets: `CAP` times its predicted steps'
    minutes (never below its share of the budget)."""
    assert plan.calibration is not None
    steps = plan.calibration["step_seconds"]
    share = {"grpo": plan.budget_minutes, "dpo": plan.budget_minutes, "rm": plan.budget_minutes * plan.rm_share,
             "ppo": plan.budget_minutes * (1 - plan.rm_share)}
    return {k: CAP * max(share[k], getattr(plan, f"{k}_max_steps") * steps[k] / 60) for k in share}
