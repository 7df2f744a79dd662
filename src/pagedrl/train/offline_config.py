"""The offline trainers' configs (SFT, reward model, DPO, KTO): `TrainConfig` and each algorithm's own fields,
under TRL's names. Kept beside `config.py`, which holds the shared fields and the loading, so that each
file stays one idea; the online trainers' configs are in `rl/config.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pagedrl.train.algorithms.sft_packing import PackingStrategy
from pagedrl.train.config import TrainConfig, TrainConfigError, _require, validate_router_coef
from pagedrl.train.dpo_losses import (
    DISCOPOP_TAU,
    F_ALPHA_COEF,
    DPOLossType,
    FDivergence,
    dpo_settings_problem,
)
from pagedrl.train.kto_losses import KTOLossType, uses_kl

TruncationMode = Literal["keep_start", "keep_end"]  # TRL's SFT and DPO truncation_mode


@dataclass
class SFTConfig(TrainConfig):
    learning_rate: float = 2e-5
    dataset_text_field: str = "text"  # column of plain-text (language modeling) rows
    completion_only_loss: bool | None = None  # None: loss on the completion when rows have one
    # chat rows: loss on the assistant's tokens only, those the chat template's {% generation %} blocks write
    assistant_only_loss: bool = False
    # a .jinja file or a tokenizer folder: the chat template of the run, saved with the model (train/sft_template.py)
    chat_template_path: str | None = None
    # TRL's packing: the examples packed once into rows of at most max_length tokens, per_device_train_batch_size
    # then counting rows (train/algorithms/sft_packing.py): bfd best-fit decreasing (an example cut to its start),
    # bfd_split the same with a longer example split into pieces, wrapped the tokens cut every max_length
    packing: bool = False
    packing_strategy: PackingStrategy = "bfd"
    # A row longer than max_length keeps its first max_length tokens, or its last (keep_end, which TRL 1.16
    # deprecates); a set that is packed is cut as its packing_strategy cuts it, whatever this says, as TRL's
    truncation_mode: TruncationMode = "keep_start"
    padding_free: bool = False  # each micro-batch's examples back to back in one row, not padded
    eval_packing: bool | None = None  # None: as packing
    shuffle_dataset: bool = False  # with packing: the examples shuffled (TRL's permutation of seed) before packing
    # Mixture of experts: the router load-balancing loss's weight (None: the model config's; 0: off).
    router_aux_loss_coef: float | None = None
    # nll: cross-entropy; dft: Dynamic Fine-Tuning, each token's cross-entropy times its (detached) probability
    loss_type: Literal["nll", "dft"] = "nll"

    def validate(self) -> None:
        super().validate()
        validate_router_coef(self.router_aux_loss_coef)
        packs = self.packing or self.eval_packing
        _require(not packs or self.max_length is not None, "eval_packing" if self.eval_packing and not self.packing
                 else "packing", "packing needs max_length, the length of a packed row")


@dataclass
class RewardConfig(TrainConfig):
    learning_rate: float = 1e-4
    center_rewards_coefficient: float | None = None  # Eisenstein et al. 2023 suggest 0.01
    disable_dropout: bool = True  # TRL's: no dropout while training, LoRA's included (lora_dropout then unused)

    def validate(self) -> None:
        super().validate()
        c = self.center_rewards_coefficient
        _require(c is None or c >= 0, "center_rewards_coefficient", f"must be null or >= 0, got {c}")


@dataclass
class ReferenceConfig(TrainConfig):
    """The fields of the offline preference trainers that train against a frozen reference (DPO, KTO),
    under TRL's names and defaults, which both of TRL's configs share."""

    learning_rate: float = 1e-6
    beta: float = 0.1
    ref_model: str | None = None  # None: a frozen copy of the starting policy
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None  # rows per batch of that pass (None: per_device_train_batch_size)
    # TR-DPO: every ref_model_sync_steps optimizer steps the reference becomes α·policy + (1-α)·reference
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6  # α
    ref_model_sync_steps: int = 512
    disable_dropout: bool = True  # TRL's: no dropout while training, LoRA's included (lora_dropout then unused)
    # Mixture of experts: the router load-balancing loss's weight (None: the model config's; 0: off).
    router_aux_loss_coef: float | None = None

    def validate(self) -> None:
        super().validate()
        validate_router_coef(self.router_aux_loss_coef)
        _require(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        size = self.precompute_ref_batch_size
        _require(size is None or (size >= 1 and self.precompute_ref_log_probs), "precompute_ref_batch_size",
                 f"must be >= 1, got {size}" if size is not None and size < 1 else
                 f"sizes the precompute_ref_log_probs pass, which is off; got {size}, expected null")
        self.validate_sync()

    def validate_sync(self) -> None:
        """TR-DPO's keys: the reference it mixes must be a full model of the policy's own (not precomputed, not
        the base under LoRA), held whole on each rank."""
        a, n = self.ref_model_mixup_alpha, self.ref_model_sync_steps
        _require(0.0 <= a <= 1.0, "ref_model_mixup_alpha", f"must be in [0, 1], got {a}")
        _require(n >= 1, "ref_model_sync_steps", f"must be >= 1, got {n}")
        for key, value, default in (("ref_model_mixup_alpha", a, 0.6), ("ref_model_sync_steps", n, 512)):
            _require(self.sync_ref_model or value == default, key,
                     f"only sync_ref_model uses it; got {value}, expected {default} or sync_ref_model: true")
        if not self.sync_ref_model:
            return
        _require(not self.precompute_ref_log_probs, "sync_ref_model", "the reference changes during training, so "
                 "its log-probs cannot be computed before it: set precompute_ref_log_probs: false")
        _require(not self.use_peft, "sync_ref_model", "with LoRA the reference is the base model itself (the "
                 "adapters switched off), no model of its own to mix, as in TRL: train without use_peft")
        _require(self.fsdp is None, "sync_ref_model", "not built with FSDP2 (fsdp), whose policy weights are "
                 "shards: use DDP or one process")


@dataclass
class DPOConfig(ReferenceConfig):
    # One of TRL's losses, or a list of them summed with loss_weights (MPO: [sigmoid, bco_pair, sft], [0.8, 0.2, 1])
    loss_type: DPOLossType | list[DPOLossType] = "sigmoid"
    loss_weights: list[float] | None = None  # None: 1 each
    label_smoothing: float = 0.0  # sigmoid, aot: conservative DPO; robust: label flip probability; exo_pair: EXO's ε
    discopop_tau: float = DISCOPOP_TAU  # the discopop loss's temperature
    # f-DPO: the divergence from the reference each answer's score follows (reverse_kl: DPO's log-ratio)
    f_divergence_type: FDivergence = "reverse_kl"
    f_alpha_divergence_coef: float = F_ALPHA_COEF  # alpha_divergence's α
    # LD-DPO: the tokens of the longer answer past the shorter one's length count α times (None: once)
    ld_alpha: float | None = None
    # WPO: each pair's losses times its answers' weights, exp of their mean log p - log Σ_v p_v² (the policy's)
    use_weighting: bool = False
    # Each of prompt + chosen and prompt + rejected longer than max_length keeps its first max_length tokens,
    # or its last (keep_end, which TRL 1.16 deprecates: the prompt's start is cut first, each answer's apart)
    truncation_mode: TruncationMode = "keep_start"
    # TRL's key: true trains as false (TRL 1.16's DPOTrainer falls back to padding too), said at start-up
    padding_free: bool = False

    def validate(self) -> None:
        super().validate()
        _require(self.ld_alpha is None or 0.0 <= self.ld_alpha <= 1.0, "ld_alpha",
                 f"must be null or in [0, 1] (1 weighs the verbose tokens as the others, 0 drops them), "
                 f"got {self.ld_alpha}")
        problem = dpo_settings_problem(self.loss_type, self.loss_weights, self.label_smoothing, self.discopop_tau,
                                       self.f_divergence_type, self.f_alpha_divergence_coef, self.use_weighting)
        if problem is not None:
            raise TrainConfigError(*problem)


@dataclass
class KTOConfig(ReferenceConfig):
    loss_type: KTOLossType = "kto"
    # Each side's losses times its weight, to counter unequal numbers of desirable and undesirable rows
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # TRL's KTO default: rows in dataset order, so that each micro-batch is the block of rows its KL
    # completions were drawn from; random (each epoch shuffled from seed) only for apo_zero_unpaired
    train_sampling_strategy: Literal["sequential", "random"] = "sequential"

    def validate(self) -> None:
        super().validate()
        for key in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, key)
            _require(math.isfinite(value) and value >= 0, key, f"must be a finite number >= 0, got {value}")
        if uses_kl(self.loss_type):
            _require(self.train_sampling_strategy == "sequential", "train_sampling_strategy",
                     f"the {self.loss_type} loss estimates its KL term from each row's neighbours in a fixed-order "
                     f"batch, which any other order breaks (TRL 1.16 refuses it too); got "
                     f"{self.train_sampling_strategy!r}, expected 'sequential' (or loss_type apo_zero_unpaired)")
            _require(self.per_device_train_batch_size > 1, "per_device_train_batch_size",
                     f"the {self.loss_type} loss estimates its KL term from the micro-batch's mismatched prompt and "
                     "completion pairs, which one row does not have (the term would equal the reward; TRL 1.16 "
                     f"refuses it too); got {self.per_device_train_batch_size}, expected > 1")
