"""What the trainers write, read by the libraries their users load it with: a run's last step saved
as transformers' Trainer saves it, config.json's dtype that of the tensors written, and a LoRA PPO
critic's adapter naming the reward model its frozen backbone came from (PEFT and `pagedrl merge`
rebuild its values from that)."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_ppo import ppo_config
from tiny_train import sft_trainer

from pagedrl.model.adapter import ADAPTER_CONFIG, write_adapter
from pagedrl.model.heads import load_sequence_scorer, save_sequence_scorer
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.merge import merge_adapter
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train import checkpointing as ckpt
from pagedrl.train.algorithms.ppo import run_ppo
from pagedrl.train.rl.reward_model import RewardModel

PAIRS = [("what is two plus three", " the answer is five"), ("hello there", " red green blue")]


def test_the_last_step_is_saved_and_a_run_extends_from_it(tiny_train_model, tmp_path) -> None:
    """transformers' Trainer saves at max_steps whatever save_steps says; save_total_limit still holds."""
    sft_trainer(tiny_train_model, tmp_path / "a", max_steps=3, save_steps=1000).train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "a")] == [3]
    resumed = sft_trainer(tiny_train_model, tmp_path / "a", max_steps=5, save_steps=1000, resume_from_checkpoint=True)
    resumed.train()
    assert resumed.step == 5 and [s for s, _ in ckpt.list_checkpoints(tmp_path / "a")] == [3, 5]
    sft_trainer(tiny_train_model, tmp_path / "b", max_steps=3, save_steps=2, save_total_limit=1).train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "b")] == [3]
    sft_trainer(tiny_train_model, tmp_path / "c", max_steps=2, save_steps=None).train()  # save_strategy "no"
    assert ckpt.list_checkpoints(tmp_path / "c") == [] and ckpt.is_complete(tmp_path / "c" / "final")


def test_saved_config_dtype_is_that_of_the_saved_tensors(tiny_train_model, tmp_path) -> None:
    """A bfloat16 base trains float32 masters: config.json says float32, and transformers loads float32."""
    base = tmp_path / "bf16-base"
    base.mkdir()
    for f in tiny_train_model.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(base / "model.safetensors").items()},
              str(base / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    sft_trainer(base, tmp_path / "run", max_steps=1, save_steps=1).train()
    for folder in (tmp_path / "run" / "final", tmp_path / "run" / "checkpoint-1"):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"F32"}
        assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
        assert transformers.AutoModelForCausalLM.from_pretrained(str(folder)).dtype == torch.float32


@pytest.fixture(scope="module")
def other_reward_model(tiny_train_model, tmp_path_factory) -> Path:
    """A one-label classifier whose backbone is not the policy's (a trained reward model's is not)."""
    folder = tmp_path_factory.mktemp("rm") / "rm"
    scorer = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for p in scorer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_sequence_scorer(scorer, folder)
    Tokenizer.from_folder(tiny_train_model).save(folder)
    return folder


def peft_scores(base: transformers.PreTrainedModel, critic: Path, rm: RewardModel) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(base, str(critic)).eval()
    ids = [rm.encode(p, r) for p, r in PAIRS]
    with torch.no_grad():
        return torch.tensor([float(model(input_ids=torch.tensor([x])).logits[0, 0]) for x in ids])


def lora_ppo(model: Path, out: Path, reward_model: Path) -> Path:
    config = ppo_config(model, out, reward_model_path=str(reward_model), critic="reward_model", use_peft=True,
                        lora_r=4, max_steps=1, eval_steps=None, num_mini_batches=1, learning_rate=1e-2)
    return run_ppo(config, progress=False) / "critic"


def test_lora_critic_names_the_reward_model_peft_loads_it_on(tiny_train_model, other_reward_model, tmp_path) -> None:
    critic = lora_ppo(tiny_train_model, tmp_path / "ppo", other_reward_model)
    assert json.loads((critic / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(other_reward_model)
    ours = RewardModel.from_pretrained(critic, device="cpu", dtype=torch.float32)  # pagedrl's loader: the field's base
    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(other_reward_model),
                                                                           dtype=torch.float32)
    theirs = peft_scores(base, critic, ours)
    assert torch.allclose(torch.tensor(ours.score(PAIRS)), theirs, atol=1e-5)
    merged = merge_adapter(None, critic, tmp_path / "merged")  # pagedrl merge, on the same base
    again = RewardModel.from_pretrained(merged, device="cpu", dtype=torch.float32)
    assert torch.allclose(torch.tensor(again.score(PAIRS)), theirs, atol=1e-5)


def test_lora_critic_on_an_adapter_reward_model_is_rebuilt_on_it(tiny_train_model, tmp_path) -> None:
    """A `pagedrl rm --use_peft` reward model has no float folder: the critic names the adapter folder,
    which pagedrl folds into its base first; PEFT gives the same values on the reward model merged."""
    rm = tmp_path / "rm-adapter"
    scorer = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(3))
    apply_lora(scorer, LoRAConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", modules_to_save=["score"],
                                  base_model_name_or_path=str(tiny_train_model)), torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in scorer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    write_adapter(scorer, rm, Tokenizer.from_folder(tiny_train_model))
    critic = lora_ppo(tiny_train_model, tmp_path / "ppo", rm)
    assert json.loads((critic / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(rm)
    ours = RewardModel.from_pretrained(critic, device="cpu", dtype=torch.float32)
    rm_base = transformers.AutoModelForSequenceClassification.from_pretrained(str(tiny_train_model), num_labels=1,
                                                                              dtype=torch.float32)
    rm_merged = peft.PeftModel.from_pretrained(rm_base, str(rm)).merge_and_unload()
    theirs = peft_scores(rm_merged, critic, ours)
    assert torch.allclose(torch.tensor(ours.score(PAIRS)), theirs, atol=1e-5)
    merged = RewardModel.from_pretrained(merge_adapter(None, critic, tmp_path / "merged"), device="cpu",
                                         dtype=torch.float32)
    assert torch.allclose(torch.tensor(merged.score(PAIRS)), theirs, atol=1e-5)


def test_reward_adapters_naming_each_other_as_bases_are_named_not_recursed(tmp_path) -> None:
    from pagedrl.model.checkpoint import CheckpointError
    from pagedrl.model.merge import merged_scorer

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, base in ((a, b), (b, a)):
        folder.mkdir()
        (folder / ADAPTER_CONFIG).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "SEQ_CLS", "base_model_name_or_path": str(base), "r": 2,
            "lora_alpha": 4, "target_modules": ["q_proj"], "modules_to_save": ["score"]}))
    with pytest.raises(CheckpointError, match=r"base leads back to an adapter already on the way"):
        merged_scorer(None, a)
