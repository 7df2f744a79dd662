"""Trainer configs: YAML + overrides, type checks, range checks, and the errors a user sees."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pagedrl.train.config import TrainConfig, TrainConfigError, config_to_dict, load_config
from pagedrl.train.offline_config import DPOConfig, RewardConfig, SFTConfig
from pagedrl.train.rl.config import GRPOConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_trl() -> None:
    grpo = GRPOConfig()
    assert (grpo.num_generations, grpo.epsilon, grpo.epsilon_high, grpo.beta) == (8, 0.2, None, 0.0)
    assert (grpo.loss_type, grpo.scale_rewards, grpo.learning_rate) == ("dapo", "group", 1e-6)
    dpo = DPOConfig()
    assert (dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.learning_rate) == (0.1, "sigmoid", 0.0, 1e-6)
    assert RewardConfig().center_rewards_coefficient is None
    assert SFTConfig().learning_rate == 2e-5
    assert SFTConfig().router_aux_loss_coef is DPOConfig().router_aux_loss_coef is grpo.router_aux_loss_coef is None
    assert TrainConfig().model == "smollm2-135m-instruct"


def test_yaml_then_overrides_with_yaml_scalar_semantics(tmp_path: Path) -> None:
    path = write(tmp_path, "beta: 0.04\noutput_dir: runs/a\nlearning_rate: 1e-5\nreward_funcs: [accuracy]\n"
                           "num_generations: 4\n")
    cfg = load_config(GRPOConfig, path, ["beta=0.2", "output_dir=runs/x", "bf16=true", "epsilon_high=0.28",
                                         "reward_funcs=[accuracy, format]", "reward_weights=[1, 0.5]"])
    assert cfg.beta == 0.2 and cfg.output_dir == "runs/x"  # overrides win over the file
    assert cfg.num_generations == 4  # the file wins over the defaults
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)  # YAML 1.1's '1e-5' string
    assert cfg.bf16 is True and cfg.epsilon_high == 0.28
    assert cfg.reward_funcs == ["accuracy", "format"]
    assert cfg.reward_weights == [1.0, 0.5] and all(isinstance(w, float) for w in cfg.reward_weights)


def test_later_overrides_win_and_null_clears_optionals() -> None:
    cfg = load_config(DPOConfig, None, ["beta=0.3", "beta=0.5", "max_length=null", "ref_model=runs/sft"])
    assert cfg.beta == 0.5 and cfg.max_length is None and cfg.ref_model == "runs/sft"


def test_the_router_coefficient_is_a_number_or_null() -> None:
    assert load_config(DPOConfig, None, ["router_aux_loss_coef=0"]).router_aux_loss_coef == 0.0
    with pytest.raises(TrainConfigError, match="router_aux_loss_coef"):
        load_config(SFTConfig, None, ["router_aux_loss_coef=.nan"])


def test_text_fields_keep_the_raw_override_text() -> None:
    cfg = load_config(SFTConfig, None, ["output_dir=2024", "dataset=yes", "report_to=tensorboard"])
    assert cfg.output_dir == "2024" and cfg.dataset == "yes"
    assert cfg.report_to == ["tensorboard"]  # a scalar for a list field is a one-element list


def test_resume_from_checkpoint_takes_a_path_or_true() -> None:
    assert load_config(TrainConfig, None, ["resume_from_checkpoint=true"]).resume_from_checkpoint is True
    cfg = load_config(TrainConfig, None, ["resume_from_checkpoint=runs/x/checkpoint-10"])
    assert cfg.resume_from_checkpoint == "runs/x/checkpoint-10"


def test_unknown_key_names_the_source_and_suggests_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, "learning_rte: 1.0e-5\n")
    with pytest.raises(ValueError, match=r"config\.yaml.*'learning_rte'.*did you mean 'learning_rate'"):
        load_config(SFTConfig, path)
    with pytest.raises(ValueError, match=r"command line.*'num_generation'.*did you mean 'num_generations'"):
        load_config(GRPOConfig, None, ["num_generation=4"])
    with pytest.raises(ValueError, match="command line.*'beta'"):
        load_config(SFTConfig, None, ["beta=0.1"])  # a DPO field is not an SFT field


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("num_generations=4.5", "num_generations: expected int"),
        ("num_generations=true", "num_generations: expected int"),
        ("beta=high", "beta: expected float"),
        ("bf16=maybe", "bf16: expected bool or null"),
        ("reward_weights=[1, two]", "reward_weights: expected a list of float or null"),
        ("loss_type=ppo", "loss_type: expected one of 'grpo', 'bnpo', 'dapo', 'dr_grpo'"),
        ("scale_rewards=max", "scale_rewards: expected one of 'group', 'batch', 'none'"),
        ("model=null", "model: expected str"),
    ],
)
def test_wrong_types_name_key_source_and_expectation(override: str, expected: str) -> None:
    with pytest.raises(ValueError, match="^command line: " + expected.replace("[", r"\[").replace("(", r"\(")):
        load_config(GRPOConfig, None, [override])


def test_wrong_type_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "per_device_train_batch_size: eight\n")
    with pytest.raises(ValueError, match=rf"^config file {path}: per_device_train_batch_size: expected int"):
        load_config(TrainConfig, path)


def test_range_errors_name_the_key_and_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(TrainConfigError, match=r"^num_generations: .*>= 2.*\(from command line\)"):
        load_config(GRPOConfig, None, ["num_generations=1"])
    path = write(tmp_path, "loss_type: robust\nlabel_smoothing: 0.5\n")
    with pytest.raises(TrainConfigError, match=rf"^label_smoothing: .*\(from config file {path}\)"):
        load_config(DPOConfig, path)
    with pytest.raises(TrainConfigError, match="label_smoothing"):
        DPOConfig(loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(TrainConfigError, match="reward_weights"):
        GRPOConfig(reward_funcs=["a", "b"], reward_weights=[1.0])
    with pytest.raises(TrainConfigError, match="report_to"):
        TrainConfig(report_to=["wandb"])
    with pytest.raises(TrainConfigError, match="max_steps"):
        TrainConfig(max_steps=0)


@pytest.mark.parametrize("cls,override,key", [
    (SFTConfig, "learning_rate=.inf", "learning_rate"), (DPOConfig, "beta=.inf", "beta"),
    (SFTConfig, "num_train_epochs=.inf", "num_train_epochs"), (GRPOConfig, "reward_weights=[1, .nan]", "reward_weights"),
    (SFTConfig, "output_dir=", "output_dir"), (SFTConfig, "model=' '", "model"),
])
def test_infinite_and_empty_values_are_refused_by_name(cls, override: str, key: str) -> None:
    # YAML reads .inf and .nan as floats; an infinite learning rate trained weights into NaN
    with pytest.raises(TrainConfigError, match=rf"^{key}: (must be finite|is empty).*\(from command line\)"):
        load_config(cls, None, ["reward_funcs=[accuracy]"] * (cls is GRPOConfig) + [override])


def test_a_key_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "learning_rate: -1\nmax_steps: 2\nlearning_rate: 1e-5\n")
    with pytest.raises(ValueError, match=r"key 'learning_rate' appears twice \(lines 1 and 3\)"):
        load_config(SFTConfig, path)


def test_file_and_override_syntax_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(TrainConfig, write(tmp_path, "- beta\n- 0.1\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(TrainConfig, write(tmp_path, "seed: [1\n"))
    with pytest.raises(ValueError, match="key=value"):
        load_config(TrainConfig, None, ["seed"])
    with pytest.raises(ValueError, match="overrides"):
        load_config(TrainConfig, None, "seed=1")
    assert load_config(TrainConfig, write(tmp_path, "")) == TrainConfig()


def test_config_to_dict_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(GRPOConfig, None, ["beta=0.04", "reward_funcs=[accuracy]", "tis_cap=null", "tis_mode=token_mask", "bf16=false"])
    data = config_to_dict(cfg)
    assert set(data) == {f.name for f in dataclasses.fields(GRPOConfig)}
    path = write(tmp_path, yaml.safe_dump(data))
    assert load_config(GRPOConfig, path) == cfg


def test_bf16_auto_is_cuda_only_and_warmup_ratio_applies_when_steps_unset() -> None:
    cfg = TrainConfig()
    assert cfg.use_bf16("cuda:0") and not cfg.use_bf16("cpu")
    assert TrainConfig(bf16=False).use_bf16("cuda") is False
    assert TrainConfig(warmup_ratio=0.1).num_warmup_steps(95) == 10
    assert TrainConfig(warmup_ratio=0.1, warmup_steps=3).num_warmup_steps(95) == 3


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_are_transformers_own(kind: str) -> None:
    """The same multiplier at every step as transformers' scheduler of that name (whose `constant`
    ignores the warm-up)."""
    import torch
    from transformers import get_scheduler

    from pagedrl.train.optim import lr_lambda

    warmup, total = 3, 12
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [lr_lambda(kind, warmup, total)(s) for s in range(total)] == pytest.approx(theirs, abs=1e-12)


def test_trls_spellings_are_read_and_its_other_options_refused_saying_so(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name_or_path: some/model\ndataset_name: data.jsonl\nmax_seq_length: 64\n"
                           "warmup_steps: 0.1\n")
    cfg = load_config(SFTConfig, path)
    assert (cfg.model, cfg.dataset, cfg.max_length, cfg.warmup_ratio, cfg.warmup_steps) == (
        "some/model", "data.jsonl", 64, 0.1, 0)
    assert load_config(DPOConfig, None, ["loss_type=[ipo]"]).loss_type == "ipo"
    grpo = ["reward_funcs=[accuracy]"]
    assert load_config(GRPOConfig, None, [*grpo, "scale_rewards=false"]).scale_rewards == "none"
    assert load_config(GRPOConfig, None, [*grpo, "scale_rewards=true"]).scale_rewards == "group"
    for key, words in (("per_device_eval_batch_size=4", "evaluations run in batches of per_device_train_batch_size"),
                       ("use_vllm=true", "own paged engine"), ("eval_strategy=epoch", "every eval_steps steps")):
        with pytest.raises(ValueError, match=rf"^command line: {key.split('=')[0]}: only .*{words}"):
            load_config(GRPOConfig, None, [*grpo, key])


def test_dpo_and_reward_models_train_without_dropout_by_default_as_in_trl() -> None:
    """TRL's DPO and reward trainers disable dropout (PEFT's included) unless told not to."""
    from pagedrl.train.adapters import lora_config

    assert lora_config(DPOConfig(use_peft=True)).lora_dropout == 0.0
    assert lora_config(RewardConfig(use_peft=True)).lora_dropout == 0.0
    assert lora_config(DPOConfig(use_peft=True, disable_dropout=False)).lora_dropout == 0.05
    assert lora_config(SFTConfig(use_peft=True)).lora_dropout == 0.05  # TRL's SFT has no such switch


def test_transformers_keys_are_answered_by_name_and_ratio_steps_read_as_transformers_5() -> None:
    """No near-miss guess for TRL / transformers keys; values that are pagedrl's behaviour are taken."""
    from pagedrl.train.trl_names import steps_of

    for key in ("logging_dir=x", "overwrite_output_dir=true", "torch_dtype=float16"):
        with pytest.raises(ValueError, match=r"TRL / transformers option SFTConfig does not have: \w") as e:
            load_config(SFTConfig, None, [key])
        assert "did you mean" not in str(e.value)
    taken = ["save_safetensors=true", "save_only_model=false", "logging_first_step=false", "torch_compile=false",
             "dataloader_num_workers=0", "remove_unused_columns=false", "remove_unused_columns=true"]
    assert load_config(SFTConfig, None, taken) == SFTConfig()
    for key, words in (("save_safetensors=false", "always written as safetensors"), ("save_only_model=true", "optimizer"),
                       ("logging_first_step=true", "logging_steps: 1"), ("torch_compile=true", "torch.compile"),
                       ("dataloader_num_workers=2", "DataLoader"), ("dataset_num_proc=4", "tokenized once"),
                       ("eos_token=x", "eos_token"), ("pad_token=x", "pad_token"), ("data_seed=1", "seed \\+ epoch"),
                       ("use_liger_kernel=true", "no Liger kernels")):
        with pytest.raises(ValueError, match=rf"{key.split('=')[0]}: only .*{words}"):
            load_config(SFTConfig, None, [key])
    cfg = load_config(SFTConfig, None, ["save_steps=0.25", "logging_steps=0.1", "eval_steps=0.5"])
    assert [steps_of(v, 40) for v in (cfg.save_steps, cfg.logging_steps, cfg.eval_steps)] == [10, 4, 20]
    assert steps_of(0.3, 7) == 3 and steps_of(5, 7) == 5  # ceil, as transformers' Trainer
    with pytest.raises(TrainConfigError, match="save_steps"):
        SFTConfig(save_steps=2.5)


def test_trl_model_config_at_its_defaults_is_taken_and_otherwise_named() -> None:
    """TRL's ModelConfig keys a TRL recipe carries at their defaults are what pagedrl does; other values,
    and PEFT options pagedrl lacks, are refused by name, never answered with a near miss (`lora_bias` was
    "did you mean 'lora_r'?"). DPO's and the reward model's `disable_dropout` stay fields of their own."""

    taken = ["use_rslora=false", "use_dora=false", "lora_modules_to_save=null", "lora_task_type=CAUSAL_LM"]
    assert load_config(SFTConfig, None, taken) == SFTConfig()
    import trl

    for f in dataclasses.fields(trl.ModelConfig):  # every field TRL's ModelConfig has, at its default
        if f.name in ("model_name_or_path", "dtype"):  # (None: pagedrl's default model; dtype: see `bf16`)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        load_config(SFTConfig, None, [f"{f.name}={yaml.safe_dump(default, default_flow_style=True).split(chr(10))[0]}"])
    assert load_config(GRPOConfig, None, ["disable_dropout=false"]) == GRPOConfig()
    assert load_config(DPOConfig, None, ["disable_dropout=false"]).disable_dropout is False
    for key, words in (("use_dora=true", "DoRA is not built"), ("use_rslora=true", "rank-stabilised"),
                       ("disable_dropout=true", "lora_dropout: 0"), ("lora_modules_to_save=[lm_head]", "score head")):
        with pytest.raises(ValueError, match=rf"{key.split('=')[0]}: only .*{words}"):
            load_config(GRPOConfig, None, [key])
    for key in ("lora_bias=true", "init_lora_weights=pissa", "rank_pattern={}", "layers_to_transform=[0]"):
        with pytest.raises(ValueError, match=r"TRL / transformers option SFTConfig does not have") as e:
            load_config(SFTConfig, None, [key])
        assert "did you mean" not in str(e.value)


def test_two_spellings_of_a_field_in_one_place_must_agree(tmp_path: Path) -> None:
    """pagedrl's name and TRL's for one field, in one file (or both on the command line), would otherwise
    leave the value to their order; the same value twice is taken, and a later place (the command line after
    the file) still wins."""
    path = write(tmp_path, "model: a/model\nmodel_name_or_path: b/model\n")
    with pytest.raises(ValueError, match=rf"^config file {path}: model and model_name_or_path both set model, to "
                                         r"'a/model' and 'b/model'; keep one"):
        load_config(SFTConfig, path)
    path = write(tmp_path, "model_name_or_path: b/model\n")
    assert load_config(SFTConfig, path, ["model=c/model"]) == SFTConfig(model="c/model")
    assert load_config(SFTConfig, None, ["model=a", "model_name_or_path=a"]).model == "a"
    with pytest.raises(ValueError, match="warmup_ratio and warmup_steps both set warmup_ratio"):
        load_config(SFTConfig, None, ["warmup_ratio=0.2", "warmup_steps=0.1"])
