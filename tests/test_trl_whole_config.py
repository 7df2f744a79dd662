"""A TRL config written out whole (`yaml.safe_dump(trl.XConfig(...).to_dict())`, every transformers and TRL
key at the value the installed TRL writes) loads in pagedrl's trainer of the same name: each key read into
pagedrl's field of the same meaning, taken at the value that is what pagedrl does, or, for a key that does
nothing here, at its default; another value of a key pagedrl does not read is refused naming it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import trl
import yaml

from pagedrl.train.algorithms.distill import DistillationConfig
from pagedrl.train.config import TrainConfig, load_config
from pagedrl.train.offline_config import DPOConfig, KTOConfig, RewardConfig, SFTConfig
from pagedrl.train.rl.config import GRPOConfig, RLOOConfig

CONFIGS = {"SFTConfig": SFTConfig, "DPOConfig": DPOConfig, "KTOConfig": KTOConfig, "GRPOConfig": GRPOConfig,
           "RewardConfig": RewardConfig, "RLOOConfig": RLOOConfig, "DistillationConfig": DistillationConfig}
RECIPE = dict(learning_rate=1e-4, num_train_epochs=2, max_steps=100, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, warmup_steps=0.1, lr_scheduler_type="cosine", logging_steps=5,
              save_steps=50, seed=7, bf16=True)


def trl_dump(tmp_path: Path, name: str, change: dict[str, Any] | None = None, **kwargs: Any) -> Path:
    """The YAML a TRL user gets from the installed TRL's config `name` (on the CPU), with `change` written over it."""
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False) | kwargs
    with warnings.catch_warnings():  # transformers' FutureWarnings about its own deprecated keys
        warnings.simplefilter("ignore")
        data = getattr(trl, name)(**options).to_dict()
    data.update(change or {})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_whole_trl_config_loads_with_trls_defaults_read_as_pagedrls(name: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(trl, name)(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False)
    ours = load_config(CONFIGS[name], trl_dump(tmp_path, name))
    mine = CONFIGS[name]()
    for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs",
                "max_steps", "lr_scheduler_type", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                "max_grad_norm", "seed", "logging_steps", "save_steps", "eval_steps"):
        assert getattr(ours, key) == getattr(theirs, key) == getattr(mine, key), key
    assert ours.optim == "adamw_torch_fused" == theirs.optim  # transformers 5's default, built as torch's fused AdamW
    assert ours.gradient_checkpointing is theirs.gradient_checkpointing is True
    assert (ours.output_dir, ours.use_cpu, ours.bf16, ours.report_to) == (str(tmp_path / "out"), True, False, [])
    assert (ours.warmup_steps, ours.warmup_ratio, ours.lr_scheduler_kwargs) == (0, 0.0, {})
    assert ours.eval_on_start is False
    if name == "GRPOConfig":
        for key in ("num_generations", "epsilon", "beta", "loss_type", "temperature", "max_completion_length",
                    "top_p", "num_iterations", "mask_truncated_completions"):
            assert getattr(ours, key) == getattr(theirs, key) == getattr(mine, key), key
        assert (ours.tis_mode, ours.tis_cap, ours.num_completions_to_print) == ("sequence_mask", 3.0, None)
    if name == "RLOOConfig":
        for key in ("num_generations", "epsilon", "epsilon_high", "beta", "temperature", "max_completion_length",
                    "top_p", "num_iterations", "mask_truncated_completions", "normalize_advantages",
                    "reward_clip_range"):
            assert getattr(ours, key) == getattr(theirs, key) == getattr(mine, key), key
        assert (ours.num_generations, ours.beta, ours.num_completions_to_print) == (2, 0.05, None)
    if name == "DPOConfig":
        assert (ours.beta, ours.loss_type, ours.max_length, ours.disable_dropout) == (0.1, "sigmoid", 1024, True)
    if name == "KTOConfig":
        assert (ours.beta, ours.loss_type, ours.desirable_weight, ours.undesirable_weight, ours.max_length,
                ours.disable_dropout, ours.train_sampling_strategy, ours.precompute_ref_log_probs) == (
            theirs.beta, theirs.loss_type, theirs.desirable_weight, theirs.undesirable_weight, theirs.max_length,
            True, theirs.train_sampling_strategy, False) == (0.1, "kto", 1.0, 1.0, 1024, True, "sequential", False)
    if name == "SFTConfig":
        assert (ours.max_length, ours.packing, ours.assistant_only_loss) == (theirs.max_length, False, False)
    if name == "RewardConfig":
        assert (ours.center_rewards_coefficient, ours.disable_dropout) == (None, True)
    if name == "DistillationConfig":
        assert (ours.beta, ours.temperature, ours.num_generations, ours.log_completions) == (1.0, 1.0, 1, False)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_recipes_common_values_map_to_pagedrls_fields(name: str, tmp_path: Path) -> None:
    """transformers 5 has no warmup_ratio: its warmup_steps below 1 is the ratio."""
    ours = load_config(CONFIGS[name], trl_dump(tmp_path, name, **RECIPE))
    got = {k: getattr(ours, k) for k in RECIPE if k != "warmup_steps"}
    assert got == {k: v for k, v in RECIPE.items() if k != "warmup_steps"}
    assert (ours.warmup_ratio, ours.warmup_steps) == (0.1, 0)
    if name in ("GRPOConfig", "RLOOConfig"):  # TRL's resolved steps_per_generation 2 and generation_batch_size 8 are pagedrl's
        assert ours.per_device_train_batch_size * ours.gradient_accumulation_steps == 8


COMMON_CHANGES = [("fp16", True), ("tf32", True), ("optim_args", "momentum=0.9"), ("push_to_hub", True),
                  ("hub_token", "hf_secret"), ("local_rank", 0), ("save_strategy", "epoch"), ("eval_strategy", "epoch"),
                  ("logging_strategy", "epoch"), ("label_smoothing_factor", 0.1), ("neftune_noise_alpha", 5.0),
                  ("dataloader_drop_last", True), ("per_device_eval_batch_size", 16), ("deepspeed", "ds.json"),
                  ("load_best_model_at_end", True), ("accelerator_config", {"split_batches": True})]
GRPO_CHANGES = [("steps_per_generation", 4), ("generation_batch_size", 16), ("use_vllm", True),
                ("vllm_gpu_memory_utilization", 0.9), ("repetition_penalty", 1.1), ("entropy_coef", 0.01),
                ("multi_objective_aggregation", "normalize_then_sum"), ("top_entropy_quantile", 0.2)]
# KTOConfig's keys pagedrl does not build
KTO_CHANGES = [("activation_offloading", True), ("pad_to_multiple_of", 8), ("dataset_num_proc", 4),
               ("model_init_kwargs", {"revision": "main"}), ("trust_remote_code", True)]


@pytest.mark.parametrize("name", CONFIGS)
def test_another_value_of_a_key_pagedrl_does_not_read_is_refused_naming_it(name: str, tmp_path: Path) -> None:
    own = {"GRPOConfig": GRPO_CHANGES, "RLOOConfig": GRPO_CHANGES, "KTOConfig": KTO_CHANGES}.get(name, [])
    for key, value in COMMON_CHANGES + own:
        path = trl_dump(tmp_path, name, {key: value})
        with pytest.raises(ValueError, match=rf"^config file {path}: {key}: only ") as e:
            load_config(CONFIGS[name], path)
        assert "got" in str(e.value), key


def test_whole_numbers_of_float_keys_are_their_value_and_a_token_is_not_echoed() -> None:
    """A hand-written recipe's `label_smoothing_factor: 0` is TRL's 0.0 (a bool is not a number here); a
    refused `hub_token` is not written into the error, where logs would keep it."""
    for key, value in (("label_smoothing_factor", 0), ("repetition_penalty", 1), ("top_entropy_quantile", 1),
                       ("entropy_coef", 0)):
        config = GRPOConfig if key != "label_smoothing_factor" else SFTConfig
        load_config(config, None, [f"{key}={value}", *(["reward_funcs=[accuracy]"] if config is GRPOConfig else [])])
    with pytest.raises(ValueError, match="only 0.0"):
        load_config(SFTConfig, None, ["label_smoothing_factor=false"])
    with pytest.raises(ValueError, match=r"hub_token: only .*got a value \(not shown\)") as e:
        load_config(SFTConfig, None, ["hub_token=hf_abcSECRET"])
    assert "SECRET" not in str(e.value)


def test_grpo_generation_batches_are_accepted_only_where_they_are_pagedrls(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A step generates per_device × accumulation × processes completions: TRL's resolved defaults, or null."""
    path = trl_dump(tmp_path, "GRPOConfig", {"steps_per_generation": None, "generation_batch_size": None})
    assert load_config(GRPOConfig, path).gradient_accumulation_steps == 1
    path = trl_dump(tmp_path, "GRPOConfig", {"generation_batch_size": None}, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, steps_per_generation=4)
    with pytest.raises(ValueError, match=r"steps_per_generation: only 2 or null, got 4: pagedrl generates each "
                                         r"optimizer step's own completions"):
        load_config(GRPOConfig, path)
    path = trl_dump(tmp_path, "GRPOConfig")  # written by one process: a generation batch of 8
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"generation_batch_size: only 16 or null, got 8: .* 2 process\(es\) = 16"):
        load_config(GRPOConfig, path)
    assert load_config(GRPOConfig, path, ["generation_batch_size=16"]).per_device_train_batch_size == 8


def test_strategies_read_as_steps_and_the_token_placeholders_as_unset(tmp_path: Path) -> None:
    """eval_strategy / save_strategy "no" is none, whatever eval_steps / save_steps say beside it (TRL writes
    save_steps: 500 there), unless the command line sets them; "steps" needs them. to_dict() writes every *_token
    key as <KEY> whatever it held: read as TRL's default."""
    path = trl_dump(tmp_path, "SFTConfig", {"save_strategy": "no", "eval_strategy": "steps", "eval_steps": 20})
    config = load_config(SFTConfig, path)
    assert (config.save_steps, config.eval_steps) == (None, 20)
    assert load_config(SFTConfig, path, ["save_steps=100"]).save_steps == 100
    path = trl_dump(tmp_path, "SFTConfig", {"eval_strategy": "no", "eval_steps": 20})
    assert load_config(SFTConfig, path).eval_steps is None
    for change, words in (({"eval_strategy": "steps"}, "eval_strategy: 'steps' needs eval_steps"),
                          ({"save_strategy": "steps", "save_steps": None}, "save_strategy: 'steps' needs save_steps"),
                          ({"activation_checkpointing": False}, "both set gradient_checkpointing")):
        with pytest.raises(ValueError, match=words):
            load_config(SFTConfig, trl_dump(tmp_path, "SFTConfig", change))
    assert isinstance(load_config(SFTConfig, trl_dump(tmp_path, "SFTConfig", {"pad_token": None})), TrainConfig)


def test_grpo_num_completions_to_print_null_logs_every_completion() -> None:
    """TRL's null: every completion of the logged step, not a count."""
    from types import SimpleNamespace

    from pagedrl.train.rl.online import OnlineAlgorithm

    class Rollout:
        def __len__(self) -> int:
            return 12

        def sample_rows(self, k: int, names: list[str], **values: Any) -> list[int]:
            return list(range(min(k, len(self))))

    for k, rows in ((None, 12), (4, 4), (0, 0)):
        algo = SimpleNamespace(config=GRPOConfig(num_completions_to_print=k), rollout=Rollout(), reward_funcs=[],
                               completion_values=dict)
        assert len(OnlineAlgorithm.sample_completions(algo, 1)) == rows  # type: ignore[arg-type]
