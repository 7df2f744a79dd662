"""LoRA runs of every trainer (`use_peft`): only the adapters (and a reward model's or critic's head)
change while the base stays bit-identical, DPO/GRPO/PPO take the base as the reference without a
copy, the engine generates with the live adapter and forgets its prefix cache after an adapter
step, checkpoints resume bit-exactly, and `final/` is a PEFT adapter that peft loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import decoder_bound
import peft
import pytest
import torch
import transformers
from preference_data import preference_rows
from test_ppo import ppo_config, rows_of
from test_trainer_resume import Interrupted, interrupt_at, metric_rows
from tiny_train import arithmetic_rows

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_weights
from pagedrl.model.heads import load_sequence_scorer
from pagedrl.model.loader import load_model
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import attach_lora
from pagedrl.train.algorithms.dpo import DPO, answer_logps
from pagedrl.train.algorithms.grpo import GRPO
from pagedrl.train.algorithms.ppo import PPO, run_ppo
from pagedrl.train.algorithms.rm import RewardModeling
from pagedrl.train.algorithms.sft import SFT
from pagedrl.train.checkpointing import seed_everything
from pagedrl.train.config import TrainConfigError
from pagedrl.train.distributed import DistInfo
from pagedrl.train.offline_config import DPOConfig, RewardConfig, SFTConfig
from pagedrl.train.rl.config import GRPOConfig, PPOConfig
from pagedrl.train.rl.critic import load_critic, lora_critic
from pagedrl.train.tokenization import tokenize_prompt
from pagedrl.train.trainer import Trainer

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.1, learning_rate=1e-2, logging_steps=1,
            save_steps=1000, seed=0, report_to=["jsonl"])


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_only_adapters_changed(module: torch.nn.Module, before: dict[str, torch.Tensor],
                                 heads: tuple[str, ...] = ()) -> None:
    """Every base tensor bit-identical; every lora_B (zero at the start) and every head moved."""
    after = module.state_dict()
    trained = [k for k in after if ".lora_" in k or k.startswith(heads)]
    assert trained and any(".lora_B." in k for k in trained)
    for k, v in after.items():
        if k in trained:
            if ".lora_A." not in k:
                assert not torch.equal(v, before[k]), f"{k} did not train"
        else:
            assert torch.equal(v, before[k]), f"base tensor {k} changed"
    frozen = [n for n, p in module.named_parameters() if p.requires_grad and n not in trained]
    assert not frozen, frozen


def transformers_freq_error(model, hf) -> torch.Tensor:
    return (hf.model.rotary_emb.inv_freq.double() - model.model.inv_freq.double()).abs()


def sft_trainer(model_dir: Path, out: Path, **fields) -> Trainer:
    config = SFTConfig(**{**LORA, "model": str(model_dir), "output_dir": str(out), "max_steps": 4,
                          "per_device_train_batch_size": 4, **fields})
    seed_everything(config.seed)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    dist = DistInfo()
    return Trainer(config, SFT(config, loaded.model, loaded.tokenizer, dist, arithmetic_rows()), dist, progress=False)


def test_sft_trains_the_adapter_only_resumes_exactly_and_saves_what_peft_loads(tiny_train_model, tmp_path) -> None:
    fields = dict(save_steps=2, lora_target_modules=["all-linear"])
    straight = sft_trainer(tiny_train_model, tmp_path / "a", **fields)
    before = snapshot(straight.module)
    final = straight.train()
    assert_only_adapters_changed(straight.module, before)
    assert sorted(p.name for p in final.iterdir() if p.name.startswith(("adapter", "model"))) == \
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert json.loads((final / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(tiny_train_model)
    # peft loads final/ on the base and computes what the trainer's module computes.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_train_model, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, final).eval()
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits
        ours = straight.module.eval().logits(straight.module(ids))
    probed = decoder_bound.logits(straight.module, ids, freq_error=transformers_freq_error(straight.module, hf))
    for got in (ref, ours):  # within float32's bound (~1e-5) of the exact logits of the adapted model
        assert ((got.double() - probed.exact).abs() <= probed.bound()).all()
    # Interrupted after step 3, resumed from checkpoint-2: the same metrics, the same adapter.
    first = sft_trainer(tiny_train_model, tmp_path / "b", **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    sft_trainer(tiny_train_model, tmp_path / "b", resume_from_checkpoint=True, **fields).train()
    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    a, b = read_adapter_weights(final), read_adapter_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reward_model_trains_adapter_and_whole_head_and_peft_scores_the_same(tiny_train_model, tmp_path) -> None:
    config = RewardConfig(**{**LORA, "model": str(tiny_train_model), "output_dir": str(tmp_path / "rm"),
                             "max_steps": 3, "per_device_train_batch_size": 8})
    seed_everything(0)
    model = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(0))
    attach_lora(config, model, "SEQ_CLS", ["score"])
    before = snapshot(model)
    trainer = Trainer(config, RewardModeling(config, model, Tokenizer.from_folder(tiny_train_model), DistInfo(),
                                             preference_rows(16)), DistInfo(), progress=False)
    final = trainer.train()
    assert_only_adapters_changed(model, before, heads=("score.",))
    saved = json.loads((final / ADAPTER_CONFIG).read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_train_model, num_labels=1,
                                                                         dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, final).eval()
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits[0, 0]
        ours = model.eval().scores(model(ids))[0, -1]
    probed = decoder_bound.logits(model, ids, freq_error=transformers_freq_error(model, hf), head=model.score)
    for got in (ref, ours):  # within float32's bound of the exact score of the adapted model
        assert abs(float(got) - float(probed.exact[0, -1, 0])) <= float(probed.bound()[0, -1, 0])


def test_dpo_uses_the_base_as_reference_without_a_copy(tiny_train_model, tmp_path) -> None:
    config = DPOConfig(**{**LORA, "model": str(tiny_train_model), "output_dir": str(tmp_path / "dpo"),
                          "max_steps": 3, "per_device_train_batch_size": 8, "use_cpu": True})
    seed_everything(0)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    before = snapshot(loaded.model)
    algorithm = DPO(config, loaded.model, loaded.tokenizer, DistInfo(), preference_rows(16))
    assert algorithm.reference is None and algorithm.base_is_reference
    Trainer(config, algorithm, DistInfo(), progress=False).train()
    assert_only_adapters_changed(loaded.model, before)
    rows = metric_rows(tmp_path / "dpo")
    assert rows[0]["rewards/margins"] == 0.0  # B = 0 at the start: policy = reference
    assert rows[-1]["rewards/margins"] != 0.0
    # The reference log-probs are those of the untouched base model.
    base = load_model(tiny_train_model, device="cpu", dtype=torch.float32).model
    batch = algorithm.collate(algorithm.examples[:4])
    with torch.no_grad():
        expected = answer_logps(base, batch).logps
    exact, bound = decoder_bound.answer_logprob_sums(base, batch)
    for got in (algorithm.reference_logps(batch), expected):
        assert ((got.double() - exact).abs() <= bound).all()
    assert ((answer_logps(loaded.model.eval(), batch).logps.double() - exact).abs() > bound).any()  # trained away


@pytest.fixture()
def prompts_file(tmp_path: Path) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}], "answer": a + b}
            for a in range(4) for b in range(4)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def token_sum(prompts, completions, completion_ids, **kw):\n"
        "    return [(sum(ids) % 7) / 7.0 for ids in completion_ids]\n")
    return path


def grpo_trainer(model_dir: Path, prompts_file: Path, **fields) -> Trainer:
    config = GRPOConfig(**{**LORA, "model": str(model_dir), "dataset": str(prompts_file),
                           "output_dir": str(prompts_file.parent / "grpo"), "num_generations": 4,
                           "per_device_train_batch_size": 8, "max_completion_length": 8, "max_steps": 2,
                           "reward_funcs": [f"{prompts_file.parent}/rewards.py:token_sum"], "beta": 0.1,
                           "lora_target_modules": ["all-linear"], **fields})
    seed_everything(0)
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    algorithm = GRPO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
    return Trainer(config, algorithm, DistInfo(), progress=False)


def test_grpo_trains_the_adapter_with_the_base_as_reference(tiny_train_model, prompts_file) -> None:
    trainer = grpo_trainer(tiny_train_model, prompts_file)
    algorithm = trainer.algorithm
    assert algorithm.ref_model is None and algorithm.base_is_reference
    assert algorithm.llm.engine.model is algorithm.model  # rollouts from the live adapter, no merge
    before = snapshot(algorithm.model)
    trainer.train()
    assert_only_adapters_changed(algorithm.model, before)
    rows = [r for r in metric_rows(prompts_file.parent / "grpo") if "kl" in r]
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0  # the policy leaves the base after one step


def test_a_bf16_grpo_step_recomputes_the_adapter_dropout_as_its_forward_ran(tiny_train_model, prompts_file) -> None:
    """Under bf16 autocast the policy's forward is batch-invariant (its rollouts' bits) and each adapter's
    dropped input is checkpointed: the recompute, in backward, must multiply as the forward did (it ran
    outside the invariant scope, saved other tensors, and the step failed)."""
    trainer = grpo_trainer(tiny_train_model, prompts_file, bf16=True, max_steps=1, gradient_checkpointing=True)
    assert trainer.algorithm.model.model.batch_invariant and trainer.config.lora_dropout > 0
    before = snapshot(trainer.algorithm.model)
    trainer.train()
    assert_only_adapters_changed(trainer.algorithm.model, before)


def test_an_adapter_step_makes_the_prefix_cache_miss(tiny_train_model, prompts_file) -> None:
    trainer = grpo_trainer(tiny_train_model, prompts_file)
    algorithm, llm = trainer.algorithm, trainer.algorithm.llm
    prompt = tokenize_prompt(algorithm.tokenizer, [{"role": "user", "content": "what is 2 plus 2 " * 6}])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    def hits_of_one_generation() -> tuple[int, list[int]]:
        hits = llm.stats()["prefix_cache_hits"]
        tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        return llm.stats()["prefix_cache_hits"] - hits, tokens

    hits_of_one_generation()
    assert hits_of_one_generation()[0] > 0  # same weights: the prompt's blocks are reused
    version = llm.stats()["weight_version"]
    # One optimizer step of the loop on the adapter alone (the base has no gradient).
    g = torch.Generator().manual_seed(1)
    for p in algorithm.model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)
    trainer.optimizer_step()
    algorithm.after_optimizer_step(1)
    assert llm.stats()["weight_version"] == version + 1
    hits, after = hits_of_one_generation()
    assert hits == 0  # KV computed before the step is never reused
    with torch.no_grad():
        model = algorithm.model.eval()
        logits = model.logits(model(torch.tensor([prompt + after])))[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == after  # the new adapter's greedy tokens
    assert hits_of_one_generation()[0] > 0  # and the new weights' blocks are cached in turn


def test_ppo_shares_one_frozen_base_between_policy_reference_and_critic(tiny_train_model, tmp_path) -> None:
    config = ppo_config(tiny_train_model, tmp_path / "ppo", reward_funcs=[f"{tmp_path}/rewards.py:has_three"],
                        critic="policy", use_peft=True, lora_r=4, lora_alpha=8, eval_steps=None)
    seed_everything(config.seed)
    loaded = load_model(tiny_train_model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    critic = load_critic("policy", Path(tiny_train_model), None, torch.device("cpu"), config.seed)
    lora_critic(config, critic, loaded.model)
    assert critic.model.embed_tokens.weight is loaded.model.model.embed_tokens.weight
    assert critic.model.layers[0].self_attn.q_proj.weight is loaded.model.model.layers[0].self_attn.q_proj.weight
    algorithm = PPO(config, loaded.model, loaded.tokenizer, DistInfo(), critic=critic,
                    eos_token_ids=loaded.eos_token_ids)
    assert algorithm.ref_model is None and algorithm.base_is_reference
    policy_before, critic_before = snapshot(loaded.model), snapshot(critic)
    final = Trainer(config, algorithm, DistInfo(), progress=False).train()
    assert_only_adapters_changed(loaded.model, policy_before)
    assert_only_adapters_changed(critic, critic_before, heads=("score.",))
    assert (final / ADAPTER_CONFIG).is_file() and (final / "critic" / ADAPTER_CONFIG).is_file()
    assert json.loads((final / "critic" / ADAPTER_CONFIG).read_text())["task_type"] == "SEQ_CLS"


def test_ppo_with_a_shared_critic_resumes_mid_rollout_exactly(tiny_train_model, tmp_path) -> None:
    fields = dict(critic="shared", reward_funcs=[f"{tmp_path}/rewards.py:has_three"], num_mini_batches=1,
                  num_ppo_epochs=2, max_steps=4, save_steps=1, eval_steps=None, use_peft=True, lora_r=4)
    run_ppo(ppo_config(tiny_train_model, tmp_path / "a", **fields), progress=False)
    expected = rows_of(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    final = run_ppo(ppo_config(tiny_train_model, tmp_path / "b", resume_from_checkpoint=True, **fields),
                    progress=False)
    assert rows_of(tmp_path / "b") == expected[3:]
    for sub in ("", "critic"):
        a, b = read_adapter_weights(tmp_path / "a" / "final" / sub), read_adapter_weights(final / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    assert "score.weight" in read_adapter_weights(final / "critic")


def test_lora_fields_are_checked_by_name(tmp_path) -> None:
    with pytest.raises(TrainConfigError, match="lora_r"):
        SFTConfig(output_dir=str(tmp_path), use_peft=True, lora_r=0)
    with pytest.raises(TrainConfigError, match="lora_target_modules"):
        PPOConfig(output_dir=str(tmp_path), use_peft=True, lora_target_modules=["embed_tokens"])
    with pytest.raises(TrainConfigError, match="lora_dropout"):
        GRPOConfig(output_dir=str(tmp_path), lora_dropout=1.0)
