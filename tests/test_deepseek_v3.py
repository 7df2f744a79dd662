"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, Kimi K2's architecture) against transformers' own class, on
tiny models: logits (latent attention, both rotary layouts, yarn's scales; DeepSeek's routing), the
config and checkpoint both ways, what the paged cache holds per token, the engine's greedy tokens
(prefix sharing, chunked prefill, preemption) and log-probs, the first SFT and DPO batches, a LoRA
adapter through PEFT, and `pagedrl serve`."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny import (
    DEEPSEEK_FAMILIES,
    assert_adapter_loads_in_peft,
    hf_model,
    ours_from,
    ours_logits,
    padded_batch,
)

from pagedrl.model.checkpoint import load_causal_lm, save_checkpoint
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.decoder import CausalLM

FAMILIES = sorted(DEEPSEEK_FAMILIES)





def max_gap(ours: CausalLM, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    return float((ours_logits(ours, ids, mask) - ref)[mask.bool()].abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_and_the_routing_rules_matter(family: str) -> None:
    """Within 1e-5 on a padded batch; the same weights without the router's correction bias, or with
    every group eligible, are far off, so both were applied (and chose differently)."""
    hf = hf_model(DEEPSEEK_FAMILIES[family])
    ours = ours_from(hf)
    ids, mask = padded_batch(hf.config.vocab_size, length=24, left=5, right=17)
    assert max_gap(ours, hf, ids, mask) < 1e-5
    routers = [layer.mlp.gate for layer in ours.model.layers[1:]]
    for router in routers:
        router.topk_group = router.n_group
    assert max_gap(ours, hf, ids, mask) > 1e-4
    for router in routers:
        router.topk_group = hf.config.topk_group
        router.e_score_correction_bias.zero_()
    assert max_gap(ours, hf, ids, mask) > 1e-4


def test_the_config_as_transformers_reads_it() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_FAMILIES["deepseek-v3-yarn"])
    rules = cfg.deepseek
    assert cfg.head_dim == 8 and cfg.kv_cache_layout == (1, 40, False) and rules.q_lora_rank is None
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in cfg.to_dict().items() if k != "model_type"}))
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(rules.softmax_scale, rel=1e-12)
    assert rules.softmax_scale != pytest.approx(24 ** -0.5)  # yarn's mscale² moved it
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(ours_from(hf).model.attention_factor, rel=1e-12)
    assert torch.equal(hf.model.rotary_emb.inv_freq, ours_from(hf).model.inv_freq)
    for change, field in [(dict(n_group=3), "n_group"), (dict(topk_group=5), "topk_group"),
                          (dict(num_key_value_heads=2), "num_key_value_heads"),
                          (dict(qk_rope_head_dim=7), "qk_rope_head_dim"), (dict(q_lora_rank=0), "q_lora_rank"),
                          (dict(quantization_config={"quant_method": "fp8"}), "quantization_config")]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_dict(dict(DEEPSEEK_FAMILIES["deepseek-v3"], **change))


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_round_trip_through_transformers(tmp_path, family: str) -> None:
    """transformers' folder loads in pagedrl; pagedrl's folder holds the very tensor names transformers
    writes (experts one by one, the router's bias) and transformers loads it with the same logits;
    loaded in bf16, the router keeps its float32 tensors."""
    hf = hf_model(DEEPSEEK_FAMILIES[family])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_causal_lm(tmp_path / "hf").eval()
    save_checkpoint(ours, tmp_path / "ours")
    names = [set(safe_open(str(tmp_path / d / "model.safetensors"), "pt").keys()) for d in ("hf", "ours")]
    assert names[0] == names[1] and "model.layers.2.mlp.gate.e_score_correction_bias" in names[1]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids, mask = padded_batch(hf.config.vocab_size, length=24, left=5, right=17)
    assert max_gap(ours, back, ids, mask) < 1e-5
    # In bf16 the router stays float32, as transformers keeps it (`_keep_in_fp32_modules_strict`).
    half = load_causal_lm(tmp_path / "hf", dtype=torch.bfloat16)
    gate, theirs = half.model.layers[2].mlp.gate, hf.model.layers[2].mlp.gate
    assert torch.equal(gate.weight, theirs.weight) and torch.equal(gate.e_score_correction_bias,
                                                                   theirs.e_score_correction_bias)
    assert half.model.layers[2].mlp.experts.down_proj.dtype == torch.bfloat16


def test_the_paged_cache_holds_one_latent_per_token_and_layer() -> None:
    """layers × (kv_lora_rank + qk_rope_head_dim) × 4 bytes a token in float32, in the engine's cache
    and in the start-up line, beside every head's keys and values in full."""
    from pagedrl.engine.llm import LLM
    from pagedrl.model.footprint import footprint

    cfg = ModelConfig.from_dict(DEEPSEEK_FAMILIES["deepseek-v3"])
    latent = 3 * (32 + 8) * 4
    full = 3 * 4 * ((16 + 8) + 12) * 4  # layers × heads × (key, value features) × bytes
    fp = footprint(cfg, torch.float32)
    assert (fp.kv_bytes_per_token, fp.full_kv_bytes_per_token) == (latent, full)
    assert f"latent attention: {latent} bytes a token against {full}" in fp.describe()
    cache = LLM.from_module(CausalLM(cfg).eval(), kv_cache_tokens=64, block_size=8).engine.kv_cache
    assert cache.nbytes == latent * 64 and cache.data.shape == (3, 1, 8, 8, 1, 40)
    assert cache.value_cache[1].data_ptr() == cache.key_cache[1].data_ptr()  # no value tensor


@pytest.fixture(scope="module", params=FAMILIES)
def greedy_case(request):
    from test_engine_greedy import prompts, reference

    hf = hf_model(DEEPSEEK_FAMILIES[request.param])
    batch = prompts(hf.config.vocab_size)[:4]  # two of them share a 20-token prefix
    return hf, batch, reference(hf, batch)


def test_engine_greedy_equals_generate_with_prefix_sharing_chunks_and_preemption(greedy_case) -> None:
    """transformers' `generate` tokens: twice through a roomy cache (the second pass reads the first's
    cached prefixes), the up-projection folded into the queries (the default impl); then through the
    `reference` impl, which up-projects the cached latents, with prompts prefilled 7 tokens a step in
    4-token blocks, in a cache so small that requests are preempted and recomputed."""
    from test_engine_greedy import GREEDY, MAX_NEW, engine_for, strip_eos

    hf, batch, expected = greedy_case
    llm = engine_for(hf, kv_cache_tokens=1024)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected]
    assert llm.stats()["prefix_cache_hits"] > 0
    longest = max(len(p) for p in batch) + MAX_NEW
    llm = engine_for(hf, block_size=4, kv_cache_tokens=longest + 8, max_num_batched_tokens=7,
                     attention_impl="reference")
    got = [o.outputs[0].token_ids for o in llm.generate(batch + batch, GREEDY, use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected + expected]
    assert llm.stats()["num_preemptions"] >= 3 and llm.stats()["num_blocks_used"] == 0


def test_engine_logprobs_equal_the_trainers_recompute() -> None:
    """The log-probs the engine reports for what it sampled (n=2 forks the prompt's latents), through
    the folded up-projection and through the expanded latents (`reference`), are the dense float32
    forward's, which is what a trainer recomputes."""
    from test_engine_greedy import engine_for, prompts

    from pagedrl.engine.sampling_params import SamplingParams

    hf = hf_model(DEEPSEEK_FAMILIES["deepseek-v3"])
    ours = ours_from(hf)
    batch = prompts(ours.config.vocab_size)[:3]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=0, n=2)
    outputs = [llm.generate(batch, params, use_tqdm=False) for llm in
               (engine_for(hf, kv_cache_tokens=512, max_num_batched_tokens=9, block_size=4, attention_impl=impl)
                for impl in ("fast", "reference"))]
    for prompt, out in zip(batch + batch, outputs[0] + outputs[1], strict=True):
        for comp in out.outputs:
            ids = torch.tensor([prompt + comp.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(ours.logits(ours(ids))[0, len(prompt) - 1:-1], -1)
            dense = logp.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
            assert float((torch.tensor(comp.processed_logprobs) - dense).abs().max()) < 1e-5


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    """A tiny DeepSeek-V3 folder with a tokenizer (the first of 3 layers dense, routed and shared experts)."""
    from tiny_train import build_model_dir

    fields = {k: v for k, v in DEEPSEEK_FAMILIES["deepseek-v3"].items()
              if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "model_type")}
    return build_model_dir(tmp_path_factory.mktemp("deepseek") / "model", std=0.05, **fields)


def test_first_sft_and_dpo_batches_equal_transformers(deepseek_folder, tmp_path) -> None:
    """The SFT loss of a padded batch and the DPO loss of four pairs against another DeepSeek-V3 folder,
    their gradients parameter by parameter within 1e-5 of transformers' (experts, router, latent
    projections and norms included). transformers' DeepSeek-V3 adds no router loss."""
    from first_batches import (
        assert_first_dpo_batch_equals_transformers,
        assert_first_sft_batch_equals_transformers,
    )
    from tiny_train import build_model_dir

    fields = {k: v for k, v in DEEPSEEK_FAMILIES["deepseek-v3"].items()
              if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "model_type")}
    reference = build_model_dir(tmp_path / "reference", seed=1, std=0.05, **fields)
    assert_first_sft_batch_equals_transformers(deepseek_folder, tmp_path / "sft")
    assert_first_dpo_batch_equals_transformers(deepseek_folder, reference, tmp_path / "dpo")


ATTENTION_PROJECTIONS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_loads_in_peft_with_the_same_logits_and_generation(tmp_path, family: str) -> None:
    """Adapters on every attention projection (compressed or plain queries) that PEFT loads onto
    transformers' model with the same logits; the engine, running the adapted model (its kv_b_proj
    adapter up-projecting cached latents), generates PEFT's greedy tokens."""

    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.model.lora import LoRAConfig, apply_lora, lora_layers

    hf = hf_model(DEEPSEEK_FAMILIES[family])
    ours = ours_from(hf)
    apply_lora(ours, LoRAConfig(r=4, lora_alpha=8, target_modules=ATTENTION_PROJECTIONS),
               torch.Generator().manual_seed(0))
    adapted = {name.rpartition(".")[2] for name, _ in lora_layers(ours)}
    assert adapted == set(ATTENTION_PROJECTIONS) - ({"q_proj"} if hf.config.q_lora_rank else {"q_a_proj", "q_b_proj"})
    theirs = assert_adapter_loads_in_peft(ours, hf, tmp_path / "adapter", length=24, left=5, right=17)
    prompt = padded_batch(hf.config.vocab_size, length=24, left=5, right=17)[0][0, :15].tolist()
    with torch.no_grad():
        expected = theirs.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 15, dtype=torch.long),
                                   max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 15:].tolist()
    llm = LLM.from_module(ours, kv_cache_tokens=128, block_size=4)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    assert got[:len(expected)] == expected


def test_lora_on_the_experts_is_refused_by_name() -> None:
    from pagedrl.model.lora import LoRAConfig, apply_lora

    ours = ours_from(hf_model(DEEPSEEK_FAMILIES["deepseek-v3"]))
    with pytest.raises(ValueError, match=r"mixture of experts .* \(q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj"):
        apply_lora(ours, LoRAConfig(r=4, lora_alpha=8, target_modules=["q_a_proj", "gate_proj"]))


def test_adapters_per_request_give_each_request_its_merged_checkpoints_tokens(deepseek_folder, tmp_path) -> None:
    """`enable_lora` on latent attention: adapters on q_a_proj, q_b_proj, kv_a_proj_with_mqa and o_proj (the
    step's rows) served side by side with the bare base in one batch, each request the greedy tokens of its
    adapter folded into the weights; an adapter on kv_b_proj (which multiplies cached latents) refused by name."""
    from multi_lora_cases import GREEDY, PROMPTS, merged_greedy, pagedrl_adapter

    from pagedrl import LoRARequest
    from pagedrl.engine.llm import LLM

    adapters = {"q": pagedrl_adapter(deepseek_folder, tmp_path / "q", 4, ["q_a_proj", "q_b_proj"], seed=1),
                "kvo": pagedrl_adapter(deepseek_folder, tmp_path / "kvo", 2, ["kv_a_proj_with_mqa", "o_proj"], seed=2)}
    merged = merged_greedy(deepseek_folder, adapters)
    llm = LLM(str(deepseek_folder), dtype=torch.float32, kv_cache_tokens=2048, enable_lora=True, max_loras=2,
              max_lora_rank=4)
    assert not any(name.endswith("kv_b_proj") for name in llm.engine.lora.layers)
    requests = {"q": LoRARequest("q", 1, str(adapters["q"])), "kvo": LoRARequest("kvo", 2, str(adapters["kvo"])),
                None: None}
    keys = [(name, i) for i in range(len(PROMPTS)) for name in requests]
    outs = llm.generate([PROMPTS[i] for _, i in keys], GREEDY, use_tqdm=False,
                        lora_request=[requests[name] for name, _ in keys])
    assert [o.outputs[0].token_ids for o in outs] == [merged[name][i] for name, i in keys]
    up = pagedrl_adapter(deepseek_folder, tmp_path / "up", 2, ["kv_b_proj"], seed=3)
    with pytest.raises(ValueError, match=r"adapts 'model.layers.0.self_attn.kv_b_proj': adapters per request on "
                                         r"latent attention's kv_b_proj are not supported"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("up", 3, str(up)))


def test_serve_answers_as_the_engine_generates(deepseek_folder, tmp_path) -> None:
    """`pagedrl serve` on the DeepSeek-V3 folder answers the OpenAI client with the offline engine's
    text, and its start-up line gives the latent cache's bytes a token beside full keys and values."""
    from server_process import assert_serves_the_engines_text

    assert "latent attention: 480 bytes a token against 1728" in assert_serves_the_engines_text(deepseek_folder, tmp_path)
