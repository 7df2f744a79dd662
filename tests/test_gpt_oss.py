"""gpt-oss against transformers' own class, on a tiny model (4 experts, top 2, an 8-token window the test
sequences cross, attention sinks, YaRN, a SwiGLU clamp that bites): logits, each rule mattering, the
sparse block and its gradients, the config and checkpoint both ways, the engine's greedy tokens (chunked
prefill, preemption) and log-probs, a LoRA adapter through PEFT, and MXFP4 checkpoints dequantized at
load (transformers' own dequantization as the oracle, bit for bit)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_engine_greedy import GREEDY, MAX_NEW, engine_for, prompts, reference, strip_eos
from tiny import (
    GPT_OSS_FAMILIES,
    assert_adapter_loads_in_peft,
    assert_checkpoint_round_trips,
    hf_model,
    ours_from,
    ours_logits,
    padded_batch,
)
from window_batches import kernels_only

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model import mxfp4
from pagedrl.model.checkpoint import CheckpointError, load_causal_lm, save_checkpoint
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.moe import SparseMoeBlock

RAW = GPT_OSS_FAMILIES["gpt-oss"]





def test_logits_equal_transformers_and_every_rule_matters() -> None:
    hf = hf_model(RAW)
    ours = ours_from(hf)
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) < 1e-5
    # The same weights without each rule in turn: far off, so each was applied above.
    rules = ours.config.gpt_oss
    ours.model.gpt_oss = dataclasses.replace(rules, sliding_window=1000)
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) > 1e-3
    ours.model.gpt_oss = rules
    for layer in ours.model.layers:
        layer.mlp.experts.limit = 100.0
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) > 1e-3
    ours = ours_from(hf)
    sinks = [layer.self_attn.sinks for layer in ours.model.layers]
    with torch.no_grad():
        for s in sinks:
            s.fill_(-float("inf"))
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) > 1e-3
    # YaRN: transformers' frequencies (the second pair blended), and its scale of cos and sin counts.
    ours = ours_from(hf)
    torch.testing.assert_close(ours.model.inv_freq, hf.model.rotary_emb.inv_freq, atol=0, rtol=1e-6)
    plain = hf.model.rotary_emb.compute_default_rope_parameters(hf.config)[0]
    assert bool((ours.model.inv_freq[1:2] < 0.9 * plain[1:2]).all()) and torch.equal(ours.model.inv_freq[:1], plain[:1])
    ours.model.attention_factor = 1.0
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) > 1e-4


def test_the_block_and_its_gradients_equal_transformers() -> None:
    """The router (top 2 of the logits, softmax over those) and the clamped experts on 40 rows, every
    expert used: outputs and every parameter's gradient within float32 rounding of transformers'."""
    hf = hf_model(RAW)
    ours = ours_from(hf)
    theirs, mine = hf.model.layers[0].mlp, ours.model.layers[0].mlp
    assert isinstance(mine, SparseMoeBlock)
    x = torch.randn(2, 20, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ref, got = theirs(x.clone())[0], mine(x.clone())
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    _, chosen, _ = mine.route(x.reshape(-1, x.shape[-1]))
    assert chosen.unique().numel() == 4
    probe = torch.randn_like(ref)
    (ref * probe).sum().backward()
    (got * probe).sum().backward()
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, theirs.get_parameter(name).grad, atol=2e-6, rtol=1e-5, msg=name)


def test_the_norm_rounds_as_transformers_float32_norm_in_bf16() -> None:
    """transformers keeps gpt-oss's norms in float32 (`_keep_in_fp32_modules`): on bf16 input its
    output is the float32 product rounded once; pagedrl's bf16 norm gives the same bits (the Llama
    family's order, rounding the normalised input first, does not)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from pagedrl.model.decoder import RMSNorm

    ours = ours_from(hf_model(RAW)).to(torch.bfloat16).model.layers[0].input_layernorm
    theirs, llama = GptOssRMSNorm(64, eps=1e-5), RMSNorm(64, 1e-5).bfloat16()
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.float())
        llama.weight.copy_(ours.weight)
        x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
        assert torch.equal(bits(ours(x)), bits(theirs(x)))
        assert not torch.equal(bits(llama(x)), bits(theirs(x)))


def test_config_and_checkpoint_round_trip_through_transformers(tmp_path) -> None:
    """A checkpoint written here holds transformers' own tensor names, loads in transformers with the
    same logits, and back here equal; the context is not cut to the window (only the sliding layers are)."""
    hf = hf_model(RAW)
    ours = ours_from(hf)
    assert ours.config.max_model_len == 256 and ours.config.gpt_oss.window(1) is None
    back = assert_checkpoint_round_trips(ours, hf, tmp_path / "m")
    hf.save_pretrained(tmp_path / "hf")
    assert load_file(str(tmp_path / "m" / "model.safetensors")).keys() == \
        load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    assert back.config.layer_types == hf.config.layer_types
    assert back.config.rope_parameters["rope_type"] == "yarn" and back.config.swiglu_limit == 0.3


def test_footprint_counts_as_transformers_and_the_routed_share() -> None:
    """Parameters as transformers counts them (sinks, biases and the router's included); the active
    ones: all but the 2 of 4 experts a token skips in each layer, their biases with them."""
    from pagedrl.model.footprint import footprint

    cfg = ModelConfig.from_dict(RAW)
    fp = footprint(cfg, torch.bfloat16)
    assert fp.parameters == hf_model(RAW).num_parameters()
    per_expert = 3 * 64 * 32 + 2 * 32 + 64  # gate, up, down and their biases
    assert fp.active_parameters == fp.parameters - 2 * (4 - 2) * per_expert


def test_bad_fields_are_named() -> None:
    with pytest.raises(ConfigError, match="'layer_types'"):
        ModelConfig.from_dict(dict(RAW, layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="'swiglu_limit'"):
        ModelConfig.from_dict(dict(RAW, swiglu_limit=-1))
    with pytest.raises(ConfigError, match="'quantization_config'"):
        ModelConfig.from_dict(dict(RAW, quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ConfigError, match="rope field 'factor'"):
        ModelConfig.from_dict(dict(RAW, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                          "original_max_position_embeddings": 64}))
    # A published config's shape: the rope under `rope_scaling`, the base at the top level, MXFP4 named.
    flat = {k: v for k, v in RAW.items() if k not in ("rope_parameters", "layer_types")}
    cfg = ModelConfig.from_dict(dict(flat, rope_theta=150000, quantization_config={"quant_method": "mxfp4"},
                                     rope_scaling={k: v for k, v in RAW["rope_parameters"].items() if k != "rope_theta"}))
    assert cfg.gpt_oss.layer_types == ("sliding_attention", "full_attention") and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling["factor"] == 4.0 and "quantization_config" not in cfg.to_dict()


def test_engine_greedy_equals_generate_through_chunks_and_preemption() -> None:
    """Prompts of 3-37 tokens, 12 new each, prefilled 7 tokens a step in 4-token blocks, in a cache
    so small that requests are preempted and recomputed."""
    hf = hf_model(RAW)
    batch = prompts(hf.config.vocab_size)[:4]
    expected = reference(hf, batch)
    longest = max(len(p) for p in batch) + MAX_NEW
    llm = engine_for(hf, block_size=4, kv_cache_tokens=longest + 8, max_num_batched_tokens=7)
    with kernels_only():  # the windowed, capped and sink layers on the row kernel
        got = [o.outputs[0].token_ids for o in llm.generate(batch + batch, GREEDY, use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected + expected]
    assert llm.stats()["num_preemptions"] >= 3 and llm.stats()["num_blocks_used"] == 0


def test_engine_logprobs_equal_the_dense_forward() -> None:
    """The log-probs the engine reports for what it sampled are the dense float32 forward's."""
    hf = hf_model(RAW)
    ours = ours_from(hf)
    llm = engine_for(hf, kv_cache_tokens=512, max_num_batched_tokens=9)
    batch = prompts(ours.config.vocab_size)[:3]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=0)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False), strict=True):
        comp = out.outputs[0]
        ids = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(ours.logits(ours(ids))[0, len(prompt) - 1:-1], -1)
        dense = logp.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        assert float((torch.tensor(comp.processed_logprobs) - dense).abs().max()) < 1e-5


def test_lora_on_attention_loads_in_peft_and_experts_are_refused(tmp_path) -> None:
    hf = hf_model(RAW)
    with pytest.raises(ValueError, match=r"mixture of experts.*attention projections"):
        apply_lora(ours_from(hf), LoRAConfig(r=2, target_modules=["all-linear"]))
    ours = ours_from(hf)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    apply_lora(ours, LoRAConfig(r=4, lora_alpha=8, target_modules=targets), torch.Generator().manual_seed(0))
    assert_adapter_loads_in_peft(ours, hf, tmp_path / "adapter")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantizes_as_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Every code and every scale (0..255, the extremes included), against transformers' own function."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.arange(240, dtype=torch.int32).remainder(256).to(torch.uint8).view(3, 40, 2)
    scales[0, :8] = torch.arange(240, 256, dtype=torch.int32).to(torch.uint8).view(8, 2)
    got, ref = mxfp4.dequantize(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert got.shape == ref.shape == (3, 64, 40) and got.dtype == dtype
    assert torch.equal(bits(got), bits(ref))


def mxfp4_checkpoint(folder, hf: torch.nn.Module) -> None:
    """`hf` saved, its experts' weights replaced by random MXFP4 blocks and scales (as the published
    checkpoints hold them: [E, out, in / 32, 16] and [E, out, in / 32]) and the config naming MXFP4."""
    hf.save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        state[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g,
                                                dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(118, 124, (experts, outputs, inputs // 32), generator=g,
                                                dtype=torch.uint8)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_loads_as_transformers_loads_it(tmp_path) -> None:
    """The experts dequantized to the bits transformers' loader gives them, the logits equal, and what
    pagedrl saves from it a float checkpoint (no quantization_config) that loads back the same."""
    mxfp4_checkpoint(tmp_path / "mx", hf_model(RAW))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32).eval()
    ours = load_causal_lm(tmp_path / "mx", dtype=torch.float32)
    for mine, hf_layer in zip(ours.model.layers, theirs.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(bits(getattr(mine.mlp.experts, name)), bits(getattr(hf_layer.mlp.experts, name)))
    ids, mask = padded_batch(RAW["vocab_size"])
    with torch.no_grad():
        ref = theirs(input_ids=ids, attention_mask=mask).logits
    assert float((ours_logits(ours, ids, mask) - ref)[mask.bool()].abs().max()) < 1e-5
    save_checkpoint(ours, tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    again = load_causal_lm(tmp_path / "saved", dtype=torch.float32)
    assert torch.equal(ours_logits(again, ids, mask), ours_logits(ours, ids, mask))
    bf16 = load_causal_lm(tmp_path / "mx", dtype=torch.bfloat16)  # dequantized straight into bf16
    assert torch.equal(bf16.model.layers[0].mlp.experts.down_proj, ours.model.layers[0].mlp.experts.down_proj.bfloat16())


def test_an_incomplete_mxfp4_pair_is_named(tmp_path) -> None:
    mxfp4_checkpoint(tmp_path / "mx", hf_model(RAW))
    state = load_file(str(tmp_path / "mx" / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(tmp_path / "mx" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks' \(MXFP4\) has no"):
        load_causal_lm(tmp_path / "mx", dtype=torch.float32)


def test_an_autocast_engine_casts_the_experts_weights_and_keeps_their_biases() -> None:
    """A trainer's rollout engine (bf16 autocast over float32 masters) holds bf16 copies of the stacked
    expert weights and shares their float32 biases (autocast adds those in float32, as transformers'
    `x @ W + b` does): the twin computes the masters' autocast numbers exactly."""
    from pagedrl.engine.cast_weights import CastWeights

    model = ours_from(hf_model(RAW))
    twin = CastWeights(model, torch.bfloat16).twin
    experts, masters = twin.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj_bias is masters.gate_up_proj_bias
    ids, mask = padded_batch(RAW["vocab_size"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(twin.logits(twin(ids, attention_mask=mask)), model.logits(model(ids, attention_mask=mask)))
