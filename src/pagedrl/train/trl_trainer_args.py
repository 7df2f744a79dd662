"""The keys of transformers' TrainingArguments and of TRL's GRPOConfig that a TRL config written out whole
(`yaml.safe_dump(trl.GRPOConfig(...).to_dict())`) holds beside the ones pagedrl reads as fields: each
accepted at the value that is what pagedrl does, or, for a key that does nothing here, at its default, and
refused at any other value with the reason. `trl_names.py` reads these tables; `load_config` uses them."""

from __future__ import annotations

import os
from typing import Any

_ENGINE = "rollouts always run on pagedrl's own paged engine in the training process (no vLLM server or colocation)"
_HUB = "checkpoints are written to output_dir in Hugging Face layout; upload them yourself"
_TRACKERS = "metrics go to report_to's jsonl and tensorboard, named by output_dir"
_NO_ACCELERATE = ("the processes are torchrun's and the batches pagedrl's own (DDP, or FSDP2 with `fsdp`), not "
                  "Accelerate's")
_EVAL = "an evaluation is the eval set's mean loss (and the task's accuracy) every eval_steps steps"
_LOGS = "pagedrl prints its own start-up summary and one line per logged step"
_ENTROPY = "GRPO's loss has no entropy term"
_ONE_PRECISION = "pagedrl trains in float32 or bf16 (`bf16`)"

# TRL / transformers keys that are what pagedrl does at these values (any other is refused with the reason).
TRAINING_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "fp16": ((False,), _ONE_PRECISION), "tf32": ((None, False), _ONE_PRECISION + "; TF32 matmuls are not turned on"),
    "bf16_full_eval": ((False,), "evaluations compute as training does (`bf16`)"),
    "fp16_full_eval": ((False,), "evaluations compute as training does (`bf16`)"),
    "optim_args": ((None,), "optim takes adamw_torch, adamw_torch_fused (adam_beta1, adam_beta2, adam_epsilon, "
                            "weight_decay) or sgd (plain SGD, without momentum)"),
    "optim_target_modules": ((None,), "optim updates every trainable parameter"),
    "deepspeed": ((None,), "several processes run with torchrun: DDP, or FSDP2 (`fsdp`)"),
    "fsdp_config": ((None,), "FSDP2 takes its options in `fsdp` (full_shard or shard_grad_op, auto_wrap)"),
    "parallelism_config": ((None,), "several processes run with torchrun: DDP, or FSDP2 (`fsdp`)"),
    "accelerator_config": ((None, {"dispatch_batches": None, "even_batches": True, "gradient_accumulation_kwargs":
                                   None, "non_blocking": False, "split_batches": False,
                                   "use_seedable_sampler": True}), _NO_ACCELERATE),
    "data_seed": ((None,), "the data order is drawn from `seed` (each epoch's shuffle from seed + epoch)"),
    "train_sampling_strategy": (("random",), "rows are shuffled each epoch from seed"),
    "dataloader_drop_last": ((False,), "no row is dropped: a step that passes an epoch's end takes the next "
                                       "epoch's first rows"),
    "auto_find_batch_size": ((False,), "per_device_train_batch_size is the batch; a batch that does not fit fails"),
    "full_determinism": ((False,), "torch's deterministic algorithms are not turned on"),
    "ignore_data_skip": ((False,), "a resumed run continues the data where its checkpoint left it"),
    "label_smoothing_factor": ((0.0,), "the loss is the algorithm's own, without label smoothing"),
    "neftune_noise_alpha": ((None,), "no noise is added to the embeddings (NEFTune is not built)"),
    "torch_compile_backend": ((None,), "the training model is not compiled with torch.compile"),
    "torch_compile_mode": ((None,), "the training model is not compiled with torch.compile"),
    "load_best_model_at_end": ((False,), "final/ is the last step's model; each checkpoint-N/ is a step's"),
    "metric_for_best_model": ((None,), "final/ is the last step's model; each checkpoint-N/ is a step's"),
    "greater_is_better": ((None,), "final/ is the last step's model; each checkpoint-N/ is a step's"),
    "save_on_each_node": ((False,), "the first process writes the checkpoints"),
    "restore_callback_states_from_checkpoint": ((False,), "there are no callbacks"),
    "logging_strategy": (("steps",), "pagedrl logs every logging_steps steps"),
    "average_tokens_across_devices": ((True,), "a step's token-mean losses divide by the tokens of every process"),
    "use_liger_kernel": ((False,), "pagedrl computes its losses with its own kernels; there are no Liger kernels"),
    "liger_kernel_config": ((None,), "pagedrl computes its losses with its own kernels; there are no Liger kernels"),
    "per_device_eval_batch_size": ((8,), "evaluations run in batches of per_device_train_batch_size"),
    "eval_accumulation_steps": ((None,), _EVAL), "eval_delay": ((0, 0.0), _EVAL),
    "batch_eval_metrics": ((False,), _EVAL), "include_for_metrics": (([],), _EVAL),
    "prediction_loss_only": ((False,), _EVAL), "label_names": ((None,), _EVAL),
    "eval_do_concat_batches": ((True,), _EVAL), "eval_use_gather_object": ((False,), _EVAL),
    "gradient_checkpointing_kwargs": ((None,), "gradient_checkpointing takes true or false"),
    "activation_checkpointing_kwargs": ((None,), "gradient_checkpointing takes true or false"),
    # GRPO's keys at TRL's defaults
    "use_vllm": ((False,), _ENGINE),
    "use_transformers_paged": ((False,), _ENGINE), "use_transformers_continuous_batching": ((False,), _ENGINE),
    "transformers_continuous_batching_config": ((None,), _ENGINE),
    "generation_kwargs": ((None,), "sampling takes temperature, top_p, top_k and min_p"),
    "repetition_penalty": ((1.0,), "sampling applies no repetition penalty"),
    "cache_implementation": ((None,), "the engine's KV cache is its own paged cache"),
    "chat_template_kwargs": ((None,), "prompts are rendered with the model folder's chat template as it is"),
    "max_tool_calling_iterations": ((None,), "completions are sampled once, without tool calls"),
    "cast_lm_head_to_fp32": ((False,), "the LM head computes in the run's precision, its logits then in float32"),
    "shuffle_dataset": ((True,), "prompts are shuffled each epoch from seed"),
    "multi_objective_aggregation": (("sum_then_normalize",), "the weighted rewards are summed, then normalized in "
                                                             "their group"),
    "num_generations_eval": ((None,), "evaluation answers each held-out prompt once, greedily (TRL's null "
                                       "samples num_generations answers each: evaluation metrics differ, training not)"),
    "off_policy_mask_threshold": ((None,), "no completion is masked for being off-policy"),
    "top_entropy_quantile": ((1.0,), "every completion token is trained on"),
    "entropy_coef": ((0.0,), _ENTROPY), "use_adaptive_entropy": ((False,), _ENTROPY),
    "sync_ref_model": ((False,), "GRPO's reference (beta > 0) is the starting policy throughout"),
    "log_unique_prompts": ((False,), "completions.jsonl holds each logged completion with its prompt"),
}

# Keys that do nothing on pagedrl's runtime (hub uploads, trackers, log verbosity, Accelerate's and vLLM's
# settings, device placement): dropped at their defaults, refused at other values saying why.
TRAINING_INERT: dict[str, tuple[tuple[Any, ...], str]] = {
    "push_to_hub": ((False,), _HUB), "hub_model_id": ((None,), _HUB), "hub_strategy": (("every_save",), _HUB),
    "hub_private_repo": ((None,), _HUB), "hub_always_push": ((False,), _HUB), "hub_revision": ((None,), _HUB),
    "hub_token": ((None, "<HUB_TOKEN>"), _HUB),  # to_dict() writes every *_token key as <KEY>
    "run_name": ((None,), "runs are named by output_dir"), "project": (("huggingface",), _TRACKERS),
    "trackio_space_id": ((None, "trackio"), _TRACKERS), "trackio_bucket_id": ((None,), _TRACKERS),
    "trackio_static_space_id": ((None,), _TRACKERS),
    "log_completions_hub_repo": ((None,), "sample completions go to output_dir's completions.jsonl"),
    "log_multimodal": ((True,), "prompts are text"),
    "log_level": (("passive",), _LOGS), "log_level_replica": (("warning",), _LOGS),
    "log_on_each_node": ((True,), _LOGS), "disable_tqdm": ((False, None), _LOGS), "debug": (([], ""), _LOGS),
    "skip_memory_metrics": ((True,), _LOGS),
    "logging_nan_inf_filter": ((True,), "only the logged loss would differ: a non-finite one is logged as null"), "include_num_input_tokens_seen": (("no", False), _LOGS),
    # transformers' Trainer reads none of these; example scripts do
    "do_train": ((False, True), ""), "do_eval": ((False, True), ""), "do_predict": ((False, True), ""),
    "local_rank": ((-1,), "torchrun's LOCAL_RANK places each process"),
    "ddp_backend": ((None,), "the backend is nccl on GPUs, gloo on CPUs"),
    "ddp_timeout": ((1800,), "the process group keeps torch's default timeout"),
    "ddp_find_unused_parameters": ((None,), _NO_ACCELERATE), "ddp_bucket_cap_mb": ((None,), _NO_ACCELERATE),
    "ddp_broadcast_buffers": ((None,), _NO_ACCELERATE), "ddp_static_graph": ((None,), _NO_ACCELERATE),
    "dataloader_pin_memory": ((True, False), ""), "dataloader_persistent_workers": ((False,), "no DataLoader"),
    "dataloader_prefetch_factor": ((None,), "no DataLoader"), "dataloader_in_order": ((True,), "no DataLoader"),
    "dataloader_multiprocessing_context": ((None,), "no DataLoader"),
    "length_column_name": (("length",), "rows are not grouped by length"),
    "torch_empty_cache_steps": ((None,), "pagedrl does not empty the CUDA cache between steps"),
    "enable_jit_checkpoint": ((False,), "a run stops cleanly on a signal and at max_train_minutes"),
    "use_cache": ((False,), "training computes no KV cache"),
    "ds3_gather_for_generation": ((True,), "DeepSpeed is not used"),
    "entropy_coef_delta": ((0.005,), _ENTROPY), "entropy_coef_max": ((1.0,), _ENTROPY),
    "entropy_coef_min": ((0.0,), _ENTROPY), "entropy_target": ((0.2,), _ENTROPY),
    "ref_model_mixup_alpha": ((0.6,), "GRPO's reference is not synced"),
    "ref_model_sync_steps": ((512,), "GRPO's reference is not synced"),
    "vllm_mode": (("colocate",), _ENGINE), "vllm_gpu_memory_utilization": ((0.3,), "the engine's KV cache is "
                                                                                  "sized by kv_cache_tokens"),
    "vllm_server_host": (("0.0.0.0",), _ENGINE), "vllm_server_port": ((8000,), _ENGINE),
    "vllm_server_base_url": ((None,), _ENGINE), "vllm_server_timeout": ((240.0,), _ENGINE),
    "vllm_group_port": ((51216,), _ENGINE), "vllm_tensor_parallel_size": ((1,), _ENGINE),
    "vllm_enable_sleep_mode": ((False,), _ENGINE), "vllm_model_impl": (("vllm",), _ENGINE),
    "vllm_max_model_length": ((None,), _ENGINE), "vllm_structured_outputs_regex": ((None,), _ENGINE),
}

# TRL keys a whole GRPO config writes whose accepted values depend on other fields: checked on the built config.
GRPO_CHECKED = ("steps_per_generation", "generation_batch_size")
CHECKED = ("eval_strategy", "save_strategy")  # every config's


# transformers' strategies: "no" means none whatever the `*_steps` key says (TRL writes save_steps: 500 beside
# save_strategy: "no"), so `load_config` sets the field to null; "steps" is pagedrl's reading of the field.
STRATEGY_FIELDS = {"eval_strategy": "eval_steps", "save_strategy": "save_steps"}


def check_against(key: str, value: Any, config: Any) -> str | None:
    """Why `value` of a `CHECKED` / `GRPO_CHECKED` key is not what `config` does, or None when it is."""
    if key in STRATEGY_FIELDS:
        field = STRATEGY_FIELDS[key]
        if value == "no":
            return None
        if value != "steps":
            return (f"only 'no' or 'steps', got {value!r}: pagedrl {'saves' if field == 'save_steps' else 'evaluates'} "
                    f"every {field} steps (null: never)")
        if getattr(config, field) is None:
            return f"'steps' needs {field} (pagedrl's {field}: null means never)"
        return None
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    accum = config.gradient_accumulation_steps
    per_step = config.per_device_train_batch_size * accum * world
    does = (f"pagedrl generates each optimizer step's own completions, per_device_train_batch_size × "
            f"gradient_accumulation_steps × {world} process(es) = {per_step} (num_iterations reuses them)")
    expected = accum if key == "steps_per_generation" else per_step
    if value is None or value == expected:  # None: TRL resolves it to exactly that
        return None
    return f"only {expected} or null, got {value!r}: {does}"
