"""LoRA on a mixture of experts' stacked weights (PEFT's `target_parameters`) against PEFT on the same
weights (Mixtral, Qwen3-MoE, gpt-oss, and DeepSeek-V3's routed experts): logits with the adapter, adapters saved by either side loaded by the other, the first SFT
batch's loss and gradients, the merged model, the engine's greedy tokens; SFT, GRPO and PPO runs.
(Adapters per request on experts: tests/test_expert_slots.py.)"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from first_batches import assert_first_sft_batch_equals_peft
from safetensors.torch import load_file
from test_grpo import assert_first_step_ratio_is_one, bf16_rollout_gaps, grpo, write_prompts
from tiny import (
    DEEPSEEK_FAMILIES,
    FAMILIES,
    GPT_OSS_FAMILIES,
    assert_adapter_loads_in_peft,
    hf_model,
    ours_from,
    ours_logits,
    padded_batch,
)

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter
from pagedrl.model.checkpoint import save_checkpoint
from pagedrl.model.lora import LoRAConfig, apply_lora, disable_adapter
from pagedrl.model.merge import merge_adapter

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOLERANCE = 1e-5
ALL = FAMILIES | GPT_OSS_FAMILIES | DEEPSEEK_FAMILIES


def adapted(family: str, targets: list[str] | None = None, parameters: list[str] = EXPERTS):
    """transformers' tiny model of `family` and pagedrl's twin with expert adapters (B still zero)."""
    hf = hf_model(ALL[family])
    ours = ours_from(hf)
    config = LoRAConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, target_parameters=parameters)
    apply_lora(ours, config, torch.Generator().manual_seed(0))
    return hf, ours


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_expert_adapter_gives_peft_logits_both_ways(tmp_path, family) -> None:
    hf, ours = adapted(family)
    assert_adapter_loads_in_peft(ours, hf, tmp_path / "ours")  # within 1e-5, and the adapter counts
    config = json.loads((tmp_path / "ours" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == EXPERTS and config["lora_dropout"] == 0
    # With target_modules unset, PEFT adapts the parameters alone (its default modules for the model type,
    # Mixtral's q_proj and v_proj, do not come with them): the tensors are those PEFT makes of the same
    # settings, under the same names and shapes.
    assert config["target_modules"] == []
    same = peft.get_peft_model(hf_model(ALL[family]), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                      target_parameters=EXPERTS))
    want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(same).items()}
    assert {k: tuple(v.shape) for k, v in load_file(tmp_path / "ours" / ADAPTER_WEIGHTS).items()} == want
    keys = sorted(want)
    layer = next(k for k in keys if ".mlp.experts." in k).partition(".mlp.experts.")[0] + ".mlp.experts."
    assert [k for k in keys if k.startswith(layer)] == [f"{layer}base_layer.lora_A.weight",
                                                        f"{layer}base_layer.lora_B.weight",
                                                        f"{layer}lora_A.weight", f"{layer}lora_B.weight"]
    # PEFT's own adapter, trained on attention and experts, loads here with PEFT's logits.
    peft_config = peft.LoraConfig(r=2, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "o_proj"],
                                  target_parameters=EXPERTS)
    theirs = peft.get_peft_model(hf_model(ALL[family]), peft_config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    theirs.save_pretrained(tmp_path / "peft")
    fresh = ours_from(hf_model(ALL[family]))
    loaded = load_adapter(fresh, tmp_path / "peft")
    assert sorted(loaded.target_parameters) == sorted(EXPERTS) and loaded.resolved_targets() == ["q_proj", "o_proj"]
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = theirs.eval()(input_ids=ids, attention_mask=mask).logits
    assert float((ours_logits(fresh.eval(), ids, mask) - ref)[mask.bool()].abs().max()) < TOLERANCE
    with disable_adapter(fresh), theirs.disable_adapter(), torch.no_grad():
        base = theirs(input_ids=ids, attention_mask=mask).logits
        assert float((ours_logits(fresh, ids, mask) - base)[mask.bool()].abs().max()) < TOLERANCE
    assert float((ref - base)[mask.bool()].abs().max()) > 1e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_pagedrl_merge_of_an_expert_adapter_equals_the_live_adapter(tmp_path, family) -> None:
    hf, ours = adapted(family, targets=["o_proj"])
    save_checkpoint(ours_from(hf), tmp_path / "base")
    assert_adapter_loads_in_peft(ours, hf, tmp_path / "adapter")
    ids, mask = padded_batch(hf.config.vocab_size)
    live = ours_logits(ours, ids, mask)
    merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        merged = back(input_ids=ids, attention_mask=mask).logits
    assert float((merged - live)[mask.bool()].abs().max()) < TOLERANCE


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_engine_greedy_with_expert_adapters_equals_peft_greedy(tmp_path, family) -> None:
    """The engine on the adapted module itself (how a trainer's rollouts see the live adapter) against
    transformers + peft decoding greedily, one argmax at a time."""
    hf, ours = adapted(family)
    theirs = assert_adapter_loads_in_peft(ours, hf, tmp_path / "adapter")
    ours.train()  # as a trainer holds it
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM.from_module(ours, kv_cache_tokens=1024).generate(prompts, greedy)]
    want = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(greedy.max_tokens):
                ids.append(int(theirs(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(prompt):])
    assert got == want
    with disable_adapter(ours):
        base = [o.outputs[0].token_ids for o in LLM.from_module(ours, kv_cache_tokens=1024).generate(prompts, greedy)]
    assert base != got  # the adapter changes what is generated


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_first_sft_batch_with_expert_adapters_equals_peft(tmp_path, family) -> None:
    folder = moe_folder(tmp_path / "model", "MixtralForCausalLM" if family == "mixtral" else "Qwen3MoeForCausalLM")
    # The router's loss is the trainers' addition (checked against TRL's in test_moe_trl.py): off here.
    assert_first_sft_batch_equals_peft(folder, tmp_path / "sft", lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                       lora_target_modules=["q_proj", "v_proj"], lora_target_parameters=EXPERTS,
                                       router_aux_loss_coef=0.0)


def test_expert_adapter_settings_are_refused_by_name(tmp_path) -> None:
    from pagedrl.train.config import TrainConfigError
    from pagedrl.train.offline_config import SFTConfig

    with pytest.raises(ValueError, match="lora_dropout"):
        LoRAConfig(target_parameters=EXPERTS)  # PEFT's ParamWrapper has no dropout
    with pytest.raises(TrainConfigError, match="lora_dropout"):
        SFTConfig(output_dir=str(tmp_path), use_peft=True, lora_target_parameters=EXPERTS)
    with pytest.raises(ValueError, match="not an expert's stacked weight"):
        adapted("mixtral", parameters=["mlp.experts.gate_up_proj", "self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="name no parameter"):
        adapted("qwen3-moe", parameters=["mlp.experts.w1"])
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    with pytest.raises(ValueError, match="none in this model"):
        apply_lora(ours_from(hf), LoRAConfig(lora_dropout=0.0, target_parameters=EXPERTS))


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_expert_adapters_roll_out_live_with_the_first_step_ratio_one(tmp_path, architecture) -> None:
    """LoRA on the experts' weights (B drawn, so it counts): the engine rolls out from the trainer's own
    module, adapters on, and its log-probs are the trainer's recompute's within the float32 bound."""
    model_dir = moe_folder(tmp_path / "moe", architecture, std=0.02)
    algo = assert_first_step_ratio_is_one(model_dir, write_prompts(tmp_path), use_peft=True, lora_r=4, lora_dropout=0.0,
                                          lora_target_parameters=EXPERTS)
    assert algo.llm.engine.model is algo.model  # no merge, no copy
    assert sum(1 for m in algo.model.modules() if type(m).__name__ == "ExpertLoRA") == 4


def test_bf16_expert_lora_rollouts_carry_the_trainers_own_log_probs(tmp_path) -> None:
    """The same on a mixture of experts with adapters on the experts' weights (B drawn): the engine's
    twin holds bf16 copies of them, and each expert's update is the trainer's, bit for bit."""
    from tiny import randomise_adapter
    model_dir = moe_folder(tmp_path / "moe", std=0.02)
    algo = grpo(model_dir, write_prompts(tmp_path), temperature=0.7, bf16=True, seed=3, use_peft=True, lora_r=4,
                lora_dropout=0.0, lora_target_parameters=EXPERTS)
    randomise_adapter(algo.model)
    gap, logged = bf16_rollout_gaps(algo)
    assert gap.numel() > 40 and float(gap.max()) == 0.0 and max(logged) == 0.0


def moe_folder(folder, architecture: str = "MixtralForCausalLM", std: float = 0.05):
    """A tiny trainable mixture of experts (8 experts, 2 a token) with the trainers' tokenizer."""
    from tiny_train import build_model_dir

    moe = dict(num_local_experts=8) if architecture == "MixtralForCausalLM" else \
        dict(num_experts=8, moe_intermediate_size=32)
    return build_model_dir(folder, std=std, architectures=[architecture], num_experts_per_tok=2, **moe)


def test_sft_trains_expert_adapters_resumes_exactly_and_final_loads_in_peft(tmp_path) -> None:
    from test_lora_training import assert_only_adapters_changed, sft_trainer, snapshot
    from test_trainer_resume import Interrupted, interrupt_at, metric_rows

    from pagedrl.model.adapter import read_adapter_weights

    model_dir = moe_folder(tmp_path / "model", "Qwen3MoeForCausalLM")
    fields = dict(save_steps=2, lora_dropout=0.0, lora_target_parameters=EXPERTS)
    straight = sft_trainer(model_dir, tmp_path / "a", **fields)
    before = snapshot(straight.module)
    final = straight.train()
    assert_only_adapters_changed(straight.module, before)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, final).eval()
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
    with theirs.disable_adapter(), torch.no_grad():
        base = theirs(input_ids=ids).logits
    ours = ours_logits(straight.module.eval(), ids)
    assert float((ours - ref).abs().max()) < TOLERANCE and float((ref - base).abs().max()) > 1e-3
    first = sft_trainer(model_dir, tmp_path / "b", **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    sft_trainer(model_dir, tmp_path / "b", resume_from_checkpoint=True, **fields).train()
    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    a, b = read_adapter_weights(final), read_adapter_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_trains_expert_adapters_on_policy_and_critic(tmp_path) -> None:
    from test_lora_training import assert_only_adapters_changed, snapshot
    from test_ppo import ppo_config

    from pagedrl.model.loader import load_model
    from pagedrl.train.adapters import attach_lora
    from pagedrl.train.algorithms.ppo import PPO
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.critic import load_critic, lora_critic
    from pagedrl.train.trainer import Trainer

    model_dir = moe_folder(tmp_path / "model")
    config = ppo_config(model_dir, tmp_path / "ppo", reward_funcs=[f"{tmp_path}/rewards.py:has_three"],
                        critic="policy", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                        lora_target_parameters=EXPERTS, eval_steps=None)
    seed_everything(config.seed)
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    critic = load_critic("policy", model_dir, None, torch.device("cpu"), config.seed)
    lora_critic(config, critic, loaded.model)
    algorithm = PPO(config, loaded.model, loaded.tokenizer, DistInfo(), critic=critic,
                    eos_token_ids=loaded.eos_token_ids)
    policy_before, critic_before = snapshot(loaded.model), snapshot(critic)
    final = Trainer(config, algorithm, DistInfo(), progress=False).train()
    assert_only_adapters_changed(loaded.model, policy_before)
    assert_only_adapters_changed(critic, critic_before, heads=("score.",))
    for folder in (final, final / "critic"):
        assert json.loads((folder / ADAPTER_CONFIG).read_text())["target_parameters"] == EXPERTS
