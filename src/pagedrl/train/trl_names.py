"""TRL's and transformers' config keys as a TRL user's YAML brings them: the ones pagedrl spells
otherwise (read under pagedrl's name), the values TRL writes in another form, and the ones pagedrl does
not have (refused saying so and what to do instead, never with a near-miss guess such as
`per_device_eval_batch_size` -> `per_device_train_batch_size`, which would change the training)."""

from __future__ import annotations

import math
from typing import Any

from pagedrl.train.trl_trainer_args import TRAINING_FIXED, TRAINING_INERT

# TRL / transformers name -> pagedrl's field of the same meaning.
ALIASES = {
    "model_name_or_path": "model",
    "model_revision": "revision",
    "dataset_name": "dataset",
    "max_seq_length": "max_length",
    "activation_checkpointing": "gradient_checkpointing",  # transformers 5's name; to_dict() writes both
    "evaluation_strategy": "eval_strategy",  # transformers 4's spelling
    # GRPO's correction of the rollout's log-prob gap (no vLLM here: the engine is pagedrl's own)
    "vllm_importance_sampling_correction": "tis_correction",
    "vllm_importance_sampling_mode": "tis_mode",
    "vllm_importance_sampling_clip_max": "tis_cap",
    "vllm_importance_sampling_cap": "tis_cap",  # TRL's deprecated spelling of _clip_max
    "vllm_importance_sampling_clip_min": "tis_min",
}

# TRL keys whose null is "not given" (TRL's own `to_dict()` writes them so): dropped, never set to None.
NULL_IS_UNSET = ("vllm_importance_sampling_cap",)  # deprecated; its None leaves _clip_max in force

_ONE_PRECISION = "pagedrl trains in float32 or bf16 (`bf16`)"
_PAIR_LENGTH = "max_length bounds each prompt + answer, cut at the end (truncation), as TRL 1.16's DPO does"
# TRL / transformers keys pagedrl does not have -> why, and what to set instead.
NOT_HERE = {
    "torch_dtype": _ONE_PRECISION, "dtype": _ONE_PRECISION,
    "lora_bias": "LoRA's B matrices have no bias here", "init_lora_weights": "LoRA starts as PEFT's default "
    "(A Kaiming-uniform, B zero); other initialisations are not built",
    "rank_pattern": "every adapted projection takes lora_r", "alpha_pattern": "every adapted projection takes lora_alpha",
    "layers_to_transform": "every layer's lora_target_modules are adapted",
    "rpo_alpha": "RPO's added NLL term is TRL 1.16's sft loss: loss_type: [sigmoid, sft], loss_weights: "
    "[1, rpo_alpha]",
    "steps_per_generation": "each step generates its own rollouts (num_iterations reuses them)",
    "generation_batch_size": "each step generates per_device_train_batch_size completions",
    "sft_model_path": "PPO starts from `model`",
    "value_model_path": "PPO's critic starts from `critic` (the policy, or the reward model)",
    "logging_dir": "TensorBoard events go to output_dir/runs (report_to: [tensorboard])",
    "overwrite_output_dir": "pagedrl writes into output_dir whether or not it exists, replacing final/ and "
    "any checkpoint of the same step; resume_from_checkpoint continues a run",
    # DPO keys of TRL before 1.0 (TRL 1.16 has none of them either)
    "max_prompt_length": _PAIR_LENGTH, "max_completion_length": _PAIR_LENGTH,
    "use_logits_to_keep": "the LM head runs only on the positions that predict an answer token, always",
    "reference_free": "DPO always has a reference: the starting policy, ref_model, or with LoRA the base model",
}

# TRL / transformers keys whose accepted values are what pagedrl always does: read and dropped.
# Any other value is refused with the reason.
FIXED = {
    "save_safetensors": ((True,), "checkpoints are always written as safetensors"),
    "save_only_model": ((False,), "a checkpoint always holds the optimizer, scheduler and RNG states (resume needs "
                                  "them); final/ is the model alone"),
    "logging_first_step": ((False,), "rows are logged every logging_steps steps and at the last; logging_steps: 1 "
                                     "logs the first"),
    "torch_compile": ((False,), "the training model is not compiled with torch.compile"),
    "dataloader_num_workers": ((0,), "batches are built in the training process, without DataLoader workers"),
    # Each algorithm reads its own columns; GRPO and PPO hand the rest to reward functions.
    "remove_unused_columns": ((True, False), ""),
    # TRL's ModelConfig at its defaults (DPO and reward models have disable_dropout as a field of their own)
    "disable_dropout": ((False,), "pagedrl's models have no dropout besides LoRA's: set lora_dropout: 0"),
    "use_rslora": ((False,), "rank-stabilised LoRA is not built"),
    "use_dora": ((False,), "DoRA is not built"),
    "lora_modules_to_save": ((None,), "only LoRA's own matrices are trained (a reward model's score head too)"),
    # the algorithm sets the task: CAUSAL_LM, or SEQ_CLS for a reward model (TRL's reward example passes it)
    "lora_task_type": (("CAUSAL_LM", "SEQ_CLS"), ""),
    "attn_implementation": ((None,), "attention is pagedrl's own paged and packed kernels"),
    "bnb_4bit_quant_storage": ((None,), "4-bit weights are stored as pagedrl packs them (load_in_4bit)"),
    # TRL's SFT and GRPO keys, at their defaults what pagedrl does
    "model_init_kwargs": ((None,), "the model is loaded by `model`, `revision` and the precision keys"),
    # TRL's ScriptArguments (its other data keys are fields: dataset_config, dataset_train_split, ...)
    "dataset_streaming": ((False,), "a dataset is a local file or folder, read a record batch at a time (a "
                                    "Parquet or Arrow one); nothing is streamed from the Hub"),
    "dataset_num_proc": ((None,), "rows are read and tokenized once, in the training process (TRL's packing "
                                  "would pack each process's shard apart)"),
    # to_dict() writes every *_token key as <KEY>, whatever its value: read as TRL's default, unset
    "eos_token": ((None, "<EOS_TOKEN>"), "the end of a completion is the tokenizer's eos_token (the model folder's "
                           "tokenizer_config.json)"),
    "pad_token": ((None, "<PAD_TOKEN>"), "the padding id is the tokenizer's pad_token (the model folder's tokenizer_config.json), "
                           "never a training target"),
    # SFT's own field (train/sft_template.py); the reward model's template is the model folder's
    "chat_template_path": ((None,), "the chat template is the model folder's (chat_template.jinja or "
                                    "tokenizer_config.json): put the template there"),
    "dataset_kwargs": ((None,), "rows are always prepared (tokenized, their labels built) by pagedrl; there is "
                                "no skip_prepare_dataset: give prompt/completion, text or messages rows"),
    "trust_remote_code": ((False,), "pagedrl runs no code from a checkpoint"),
    # SFT's and DPO's own field (keep_end too); in the other trainers, which TRL gives no truncation_mode,
    # its default is taken
    "truncation_mode": (("keep_start",), "rows longer than max_length keep their start (truncation: truncate), "
                                         "or are dropped (truncation: skip)"),
    # "auto" pads to a multiple of 128 on Neuron only: nowhere pagedrl runs
    "pad_to_multiple_of": (("auto", None), "a padded batch is as long as its longest row; padding changes only "
                                           "the shape, never the loss"),
    "activation_offloading": ((False,), "activations stay on the device; gradient_checkpointing trades compute "
                                        "for their memory"),
    # SFT's and DPO's padding_free are fields of their own; TRL's other trainers have no such key
    "padding_free": ((False,), "rows are padded to the micro-batch's longest (padding never changes the loss); "
                               "only SFT and DPO take padding_free"),
    **TRAINING_FIXED,
}
# transformers 5's `*_steps` below 1: a ratio of the run's total steps (`steps_of`).
RATIO_STEPS = ("logging_steps", "eval_steps", "save_steps")


def trl_form(key: str, value: Any) -> tuple[str, Any]:
    """A key and value in the form TRL writes them, in pagedrl's: TRL's spelling of a field (`ALIASES`),
    a one-element `loss_type` list (TRL's type is a list of losses) for that loss, SFT's `packing_strategy`
    `bfd-requeue` for `bfd_split` (TRL's old name), GRPO's
    `scale_rewards` true / false for "group" / "none" (as TRL reads them), and transformers 5's
    `warmup_steps` below 1, a ratio, for `warmup_ratio` (`eval_steps`, `save_steps` and
    `logging_steps` below 1 stay ratios of the total steps: `steps_of` reads them)."""
    key = ALIASES.get(key, key)
    if key == "loss_type" and isinstance(value, list) and len(value) == 1:
        return key, value[0]
    if key == "packing_strategy" and value == "bfd-requeue":  # TRL's deprecated name, which it reads so
        return key, "bfd_split"
    if key == "scale_rewards" and isinstance(value, bool):
        return key, "group" if value else "none"
    if key == "warmup_steps" and isinstance(value, float) and 0.0 < value < 1.0:
        return "warmup_ratio", value
    return key, value


def fixed_value(key: str, value: Any, source: str) -> bool:
    """True when `key` is one of `FIXED` and `value` is what pagedrl does, or one of `TRAINING_INERT` (keys
    that do nothing here) at its default: the caller drops it. A ValueError naming the key when it asks for
    something else; False for any other key."""
    inert = key in TRAINING_INERT
    if not inert and key not in FIXED:
        return False
    allowed, why = TRAINING_INERT[key] if inert else FIXED[key]
    if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return True  # 0 and 0.0 are one value (a hand-written `label_smoothing_factor: 0`); true is not 1
    expected = " or ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
    what = "its default (the key does nothing here)" if inert else "pagedrl's behaviour"
    got = "a value (not shown)" if key.endswith("_token") and value is not None else repr(value)  # hub_token: a secret
    raise ValueError(f"{source}: {key}: only {expected} ({what}), got {got}" + (f": {why}" if why else ""))


def steps_of(value: int | float | None, total_steps: int) -> int | None:
    """An `eval_steps` / `save_steps` / `logging_steps` value as a step count: below 1 a ratio of the
    run's total steps, rounded up, as transformers 5's Trainer reads it; None stays None."""
    if value is None:
        return None
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def not_here(key: str) -> str | None:
    """Why a TRL / transformers key is not a pagedrl field, or None when it is not one of theirs."""
    return NOT_HERE.get(key)
