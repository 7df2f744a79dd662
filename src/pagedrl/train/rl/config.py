"""Configs of the online algorithms, GRPO, RLOO and PPO: what they share (prompts, generation, rewards,
the built-in task, evaluation, sample logging) in `OnlineConfig`, what the two group algorithms share
(the clipped ratio, the reference's coefficient, the rollout's reuse) in `GroupConfig`, each algorithm's
own fields in its class. Names follow TRL's GRPOConfig, RLOOConfig and PPOConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pagedrl.engine.engine_args import engine_field
from pagedrl.engine.sampling_params import MIN_TEMPERATURE
from pagedrl.train.config import TrainConfig, _require, validate_router_coef
from pagedrl.train.tis import TIS_MODES, TisMode, is_sequence_mode
from pagedrl.train.trl_trainer_args import CHECKED, GRPO_CHECKED

VESPO_DEFAULTS = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}  # TRL's


@dataclass
class OnlineConfig(TrainConfig):
    """`dataset` is a JSONL file of {"prompt", ...columns} rows, or `arithmetic` for the built-in
    task (its held-out set is then the evaluation set)."""

    learning_rate: float = 1e-6
    dataset: str | None = "arithmetic"
    # Generation (vLLM's sampling names; top_k 0 or -1 disables top-k).
    num_generations: int = 8
    # a longer prompt is an error naming the row; None (TRL has no such limit): any prompt that leaves the
    # model's context room for one completion token
    max_prompt_length: int | None = None
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    # The rollout engine's settings: EngineArgs' fields (engine/engine_args.py, where their help is
    # kept), with a trainer's defaults; `rl/online.py` makes the rest of the rollout engine's.
    kv_cache_tokens: int | None = engine_field(
        "kv_cache_tokens", help="the rollout engine's KV budget in tokens (default: one step's rollout at once)")
    batch_invariant: bool | None = engine_field(
        "batch_invariant", default=None,
        help="rollouts and training compute each token's numbers alike, bit for bit, whatever the batch "
             "(model/batch_invariant.py); default: on where training runs in bf16 on a CPU (there the sampled "
             "log-probs are otherwise ~3e-2 from the trainer's), off elsewhere and for Gemma and gpt-oss. CPU only")
    # Rewards: built-in names (numeric_match, last_integer_match, exact_match, format,
    # overlong_penalty) or "file.py:function"; empty means the task's own verifier.
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None  # None: 1.0 each
    format_pattern: str | None = None  # for the `format` reward
    overlong_buffer: int | None = None  # for `overlong_penalty`; None: max_completion_length // 4
    # The built-in arithmetic task.
    task_operations: list[str] = field(default_factory=lambda: ["+"])
    task_low: int = 10
    task_high: int = 99
    task_num_eval: int = 256
    eval_max_tokens: int | None = None  # greedy evaluation length; None: max_completion_length
    # Sample completions in completions.jsonl and TensorBoard every logging step (TRL's names).
    log_completions: bool = True
    num_completions_to_print: int | None = 4  # None: every completion of the step (TRL's None)

    def validate(self) -> None:
        super().validate()
        _require(self.num_generations >= 1, "num_generations", f"must be >= 1, got {self.num_generations}")
        _require(self.max_completion_length >= 1, "max_completion_length", f"must be >= 1, got {self.max_completion_length}")
        _require(self.temperature > 0, "temperature", f"sampling needs temperature > 0, got {self.temperature}")
        # The engine would raise a smaller temperature to MIN_TEMPERATURE; the trainer's recomputed
        # log-probs would then not be those of the distribution the tokens were drawn from.
        _require(self.temperature >= MIN_TEMPERATURE, "temperature",
                 f"must be at least {MIN_TEMPERATURE} (the engine's floor), got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must lie in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be >= -1 (0 or -1 disable), got {self.top_k}")
        _require(self.min_p is None or 0.0 <= self.min_p <= 1.0, "min_p", f"must lie in [0, 1], got {self.min_p}")
        _require(self.num_completions_to_print is None or self.num_completions_to_print >= 0, "num_completions_to_print",
                 f"must be >= 0, got {self.num_completions_to_print}")
        if self.reward_weights is not None and self.reward_funcs:
            _require(
                len(self.reward_weights) == len(self.reward_funcs),
                "reward_weights",
                f"{len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs",
            )


@dataclass
class GroupConfig(OnlineConfig):
    """What GRPO and RLOO share: a group of num_generations completions per prompt, each completion's
    advantage against its siblings, PPO's clipped importance ratio, a KL coefficient to a frozen reference,
    and num_iterations updates per rollout. `per_device_train_batch_size` counts completions, as in TRL:
    each step trains on per_device × accumulation × world completions, i.e. that / num_generations prompts."""

    trl_checked: ClassVar[tuple[str, ...]] = CHECKED + GRPO_CHECKED  # TRL's steps_per_generation, generation_batch_size

    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon; DAPO recommends 0.28
    beta: float = 0.0  # KL coefficient; 0 skips the reference model
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    # Mixture of experts: the router load-balancing loss's weight (None: the model config's; 0: off).
    router_aux_loss_coef: float | None = None

    def validate(self) -> None:
        super().validate()
        validate_router_coef(self.router_aux_loss_coef)
        _require(self.num_generations >= 2, "num_generations", f"a group needs >= 2 completions, got {self.num_generations}")
        _require(self.epsilon >= 0, "epsilon", f"must be >= 0, got {self.epsilon}")
        _require(self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high", f"must be >= 0, got {self.epsilon_high}")
        _require(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        _require(self.num_iterations >= 1, "num_iterations", f"must be >= 1, got {self.num_iterations}")


@dataclass
class RLOOConfig(GroupConfig):
    """TRL's RLOOConfig: REINFORCE with the leave-one-out baseline (Ahmadian et al. 2024). TRL's defaults
    where they differ from GRPO's: G = 2 (leave-one-out needs two), beta 0.05, its KL a penalty in the
    reward. No rollout importance weights (TRL's RLOO has none)."""

    num_generations: int = 2
    beta: float = 0.05  # k1 KL to the reference, summed over the completion, subtracted from its reward
    normalize_advantages: bool = False  # TRL's: over the whole generation batch, (A - mean) / (std + 1e-4)
    reward_clip_range: list[float] | None = None  # TRL's (min, max), clamped before the KL penalty

    def validate(self) -> None:
        super().validate()
        r = self.reward_clip_range
        _require(r is None or (len(r) == 2 and r[0] <= r[1]), "reward_clip_range",
                 f"expected null or [min, max] with min <= max, got {r}")


@dataclass
class GRPOConfig(GroupConfig):
    """GRPO, with DAPO's, Dr. GRPO's and the other TRL loss types; the group's rewards normalised by its mean
    (and std)."""

    delta: float | None = None  # INTELLECT-2 two-sided clipping cap on the ratio
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    use_bias_correction_kl: bool = True  # TRL's: the KL term times the importance ratio
    # TRL's: "token" ratios, or "sequence" (GSPO): one per completion, exp of its mean token log-ratio; GSPO clips
    # it far tighter (TRL's recipe: epsilon 3e-4, epsilon_high 4e-4, beta 0, loss_type grpo)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # cispo clips the importance weight at epsilon_high (TRL: 5.0 recommended; None: epsilon, as TRL);
    # sapo gates the ratio softly, at sapo_temperature_pos where the advantage is positive, _neg elsewhere;
    # luspo sums each completion's tokens (a completion weighs by its length), then averages completions;
    # vespo weighs each completion by φ(w) = e^λ·w^k·e^(-λw) of its importance ratio w, k and λ by the advantage's sign
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = VESPO_DEFAULTS["vespo_k_pos"]
    vespo_lambda_pos: float = VESPO_DEFAULTS["vespo_lambda_pos"]
    vespo_k_neg: float = VESPO_DEFAULTS["vespo_k_neg"]
    vespo_lambda_neg: float = VESPO_DEFAULTS["vespo_lambda_neg"]
    scale_rewards: Literal["group", "batch", "none"] = "group"
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards all agree, refill from the next prompts
    # The engine/trainer log-prob gap's importance-sampling correction (train/tis.py), TRL's vllm_importance_sampling_*
    # keys: tis_correction (_correction), tis_mode (_mode; TRL's default is sequence_mask, pagedrl's token_truncate:
    # the engine reads the trainer's own tensors, the gap is rounding), tis_cap (_clip_max, or the deprecated _cap;
    # null: no upper bound) and tis_min (_clip_min).
    tis_correction: bool = True
    tis_mode: TisMode = "token_truncate"
    tis_cap: float | None = 3.0
    tis_min: float | None = None

    def validate(self) -> None:
        super().validate()
        _require(self.delta is None or self.delta > 1.0, "delta", f"must be > 1 (it caps the ratio), got {self.delta}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.delta is None or self.loss_type not in ("cispo", "sapo", "vespo"), "delta", "is PPO-clip's cap; "
                 "cispo clips the importance weight at epsilon_high, sapo gates it softly and vespo weighs it instead")
        for name, default in VESPO_DEFAULTS.items():
            value = getattr(self, name)
            _require(value >= 0 if "_k_" in name else value > 0, name,
                     f"must be {'>= 0' if '_k_' in name else '> 0'}, got {value}")
            _require(value == default or self.loss_type == "vespo", name,
                     f"only the vespo loss uses it; got {value}, expected {default} or loss_type vespo")
        _require(self.importance_sampling_level in ("token", "sequence"), "importance_sampling_level",
                 f"expected 'token' or 'sequence', got {self.importance_sampling_level!r}")
        self.validate_tis()

    def validate_tis(self) -> None:
        """TRL's checks of its vllm_importance_sampling_* keys, and pagedrl's that the bounds keep the weight 1 of a
        token the engine and the trainer agree on. The bounds are checked with the correction off too (TRL checks
        their order so); what a mode needs only with it on."""
        _require(self.tis_mode in TIS_MODES, "tis_mode", f"expected one of {', '.join(TIS_MODES)}, got {self.tis_mode!r}")
        _require(self.tis_cap is None or self.tis_cap >= 1.0, "tis_cap", f"must be null or >= 1, got {self.tis_cap}")
        _require(self.tis_min is None or 0.0 <= self.tis_min <= 1.0, "tis_min",
                 f"must be null or in [0, 1], got {self.tis_min}")
        _require(self.tis_min is None or self.tis_cap is None or self.tis_min < self.tis_cap, "tis_min",
                 f"must be less than tis_cap, got {self.tis_min} and {self.tis_cap}")
        if self.tis_correction and self.tis_mode == "token_truncate" and self.tis_cap is None and self.tis_min is None:
            # Nothing to truncate at: what `tis_cap: null` meant before the modes (configs saved beside older
            # checkpoints say it), so it keeps meaning the correction off.
            self.tis_correction = False
        if not self.tis_correction:
            return
        _require(not self.tis_mode.endswith("_truncate") or self.tis_cap is not None or self.tis_min is not None,
                 "tis_cap", f"{self.tis_mode} needs a bound, tis_cap or tis_min (tis_correction: false turns the "
                 "correction off)")
        _require(self.loss_type != "vespo" or not is_sequence_mode(self.tis_mode), "tis_mode",
                 f"vespo weighs in the rollout's weights per token: token_truncate or token_mask, got {self.tis_mode}")


@dataclass
class PPOConfig(OnlineConfig):
    """RLHF with PPO (TRL's PPOConfig names). Each rollout samples per_device_train_batch_size ×
    gradient_accumulation_steps × num_mini_batches completions per rank (num_generations per
    prompt); it is then trained on for num_ppo_epochs epochs of num_mini_batches optimizer steps,
    each step one mini-batch of per_device × accumulation completions."""

    learning_rate: float = 3e-6
    num_generations: int = 1
    temperature: float = 0.7
    response_length: int | None = None  # TRL's name for max_completion_length; wins when set
    # The four roles.
    reward_model_path: str | None = None  # a `pagedrl rm` folder; None: score with reward_funcs
    critic: Literal["reward_model", "policy", "shared"] | None = None  # None: reward_model if one, else policy
    # Rewards: −kl_coef·KL at every token, the score at the last one.
    kl_coef: float = 0.05
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_target: float | None = None  # set: Ziegler et al.'s adaptive coefficient, aiming at this KL
    kl_horizon: int = 10000
    missing_eos_penalty: float | None = None  # subtracted from the score of a completion without EOS
    reward_clip_range: float | None = None  # clamp scores to ±this (10 is common); None: no clamp
    whiten_rewards: bool = False
    # Advantages and updates.
    gamma: float = 1.0
    lam: float = 0.95
    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    critic_warmup_steps: int = 0  # optimizer steps in which only the critic trains

    def __post_init__(self) -> None:
        if self.response_length is not None:
            self.max_completion_length = self.response_length
        super().__post_init__()

    @property
    def critic_init(self) -> str:
        return self.critic or ("reward_model" if self.reward_model_path else "policy")

    def validate(self) -> None:
        super().validate()
        for key in ("num_ppo_epochs", "num_mini_batches", "kl_horizon"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("kl_coef", "cliprange", "cliprange_value", "vf_coef", "critic_warmup_steps"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        _require(0.0 <= self.gamma <= 1.0, "gamma", f"must lie in [0, 1], got {self.gamma}")
        _require(0.0 <= self.lam <= 1.0, "lam", f"must lie in [0, 1], got {self.lam}")
        _require(self.kl_target is None or self.kl_target > 0, "kl_target", f"must be null or > 0, got {self.kl_target}")
        _require(self.reward_clip_range is None or self.reward_clip_range > 0, "reward_clip_range",
                 f"must be null or > 0, got {self.reward_clip_range}")
        _require(self.critic != "reward_model" or self.reward_model_path is not None, "critic",
                 "'reward_model' needs reward_model_path (or choose 'policy' or 'shared')")
        _require(self.reward_model_path is not None or self.reward_funcs or self.dataset == "arithmetic",
                 "reward_model_path", "PPO needs a reward: a reward model folder, or reward_funcs (verifiers)")
        mini = self.per_device_train_batch_size * self.gradient_accumulation_steps
        _require(mini * self.num_mini_batches % self.num_generations == 0, "num_generations",
                 f"a rollout of {mini * self.num_mini_batches} completions per rank is not a whole number of "
                 f"groups of {self.num_generations}")
