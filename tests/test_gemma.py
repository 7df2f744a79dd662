"""Gemma 3 and Gemma 2 against transformers' own classes, on tiny models whose 8-token sliding window
the test sequences cross: logits, the config and checkpoint both ways, the engine's greedy tokens
(chunked prefill, preemption) and log-probs, a LoRA adapter through PEFT, and the first batch of
SFT and DPO (loss and gradients)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine_greedy import GREEDY, MAX_NEW, engine_for, prompts, reference, strip_eos
from tiny import (
    GEMMA_FAMILIES,
    assert_adapter_loads_in_peft,
    assert_checkpoint_round_trips,
    hf_model,
    ours_from,
    ours_logits,
    padded_batch,
)
from window_batches import kernels_only

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.footprint import footprint
from pagedrl.model.lora import LoRAConfig, apply_lora

FAMILIES = sorted(GEMMA_FAMILIES)





@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_and_the_window_matters(family: str) -> None:
    hf = hf_model(GEMMA_FAMILIES[family])
    ours = ours_from(hf)
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) < 1e-5
    # The same weights seeing every key in every layer: far off, so the windows above were applied.
    wide = dataclasses.replace(ours.config.gemma, sliding_window=1000)
    ours.model.rules = wide
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) > 1e-3


def test_gemma3_leaves_attention_uncapped_whatever_its_config_says() -> None:
    """Gemma 3's config may carry `attn_logit_softcapping` (Gemma 2's field); its attention never applies
    it, in transformers nor in the published weights' training: logits equal transformers' with it set."""
    hf = hf_model(dict(GEMMA_FAMILIES["gemma3"], attn_logit_softcapping=2.0))
    ours = ours_from(hf)
    assert ours.config.gemma.attn_logit_softcapping is None
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    assert float((ours_logits(ours, ids, mask) - ref)[mask.bool()].abs().max()) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_checkpoint_round_trip_through_transformers(tmp_path, family: str) -> None:
    """A checkpoint written here loads in transformers with the same logits, and back here equal;
    the context is not cut to the window (only the sliding layers are)."""
    hf = hf_model(GEMMA_FAMILIES[family])
    ours = ours_from(hf)
    assert ours.config.max_model_len == 256 and ours.config.gemma.window(1) is None
    back = assert_checkpoint_round_trips(ours, hf, tmp_path / "m")
    assert back.config.layer_types == hf.config.layer_types


def test_bad_gemma_fields_are_named() -> None:
    raw = GEMMA_FAMILIES["gemma3"]
    with pytest.raises(ConfigError, match="'layer_types'"):
        ModelConfig.from_dict(dict(raw, layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="'use_bidirectional_attention'"):
        ModelConfig.from_dict(dict(raw, use_bidirectional_attention=True))
    with pytest.raises(ConfigError, match="'attn_logit_softcapping'"):
        ModelConfig.from_dict(dict(GEMMA_FAMILIES["gemma2"], attn_logit_softcapping=-1))
    # The Hub's older flat fields: a pattern of 6 and the local base beside the global rope.
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    cfg = ModelConfig.from_dict(dict(old, num_hidden_layers=7, sliding_window_pattern=6, rope_theta=1e6,
                                     rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [cfg.gemma.window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (cfg.rope_theta, cfg.gemma.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, {"rope_type": "linear",
                                                                                          "factor": 8.0})


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_generate_through_chunks_and_preemption(family: str) -> None:
    """Prompts of 3-37 tokens, 12 new each, prefilled 7 tokens a step in 4-token blocks, in a cache
    so small that requests are preempted and recomputed (the sliding layers' groups give back what left
    their window of 8, so the longest request fits in 5/8 of the bytes it would hold in every layer)."""
    hf = hf_model(GEMMA_FAMILIES[family])
    batch = prompts(hf.config.vocab_size)[:4]
    expected = reference(hf, batch)
    longest = max(len(p) for p in batch) + MAX_NEW
    llm = engine_for(hf, block_size=4, kv_cache_tokens=(longest + 8) * 5 // 8, max_num_batched_tokens=7)
    with kernels_only():  # the windowed, capped and sink layers on the row kernel
        got = [o.outputs[0].token_ids for o in llm.generate(batch + batch, GREEDY, use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected + expected]
    assert llm.stats()["num_preemptions"] >= 3 and llm.stats()["num_blocks_used"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_the_dense_forward(family: str) -> None:
    """The log-probs the engine reports for what it sampled are the dense float32 forward's."""
    ours = ours_from(hf_model(GEMMA_FAMILIES[family]))
    llm = engine_for(hf_model(GEMMA_FAMILIES[family]), kv_cache_tokens=512, max_num_batched_tokens=9)
    batch = prompts(ours.config.vocab_size)[:3]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=0)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False), strict=True):
        comp = out.outputs[0]
        ids = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(ours.logits(ours(ids))[0, len(prompt) - 1:-1], -1)
        dense = logp.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        assert float((torch.tensor(comp.processed_logprobs) - dense).abs().max()) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_loads_in_peft_with_the_same_logits(tmp_path, family: str) -> None:
    hf = hf_model(GEMMA_FAMILIES[family])
    ours = ours_from(hf)
    apply_lora(ours, LoRAConfig(r=4, lora_alpha=8, target_modules=["all-linear"]), torch.Generator().manual_seed(0))
    assert_adapter_loads_in_peft(ours, hf, tmp_path / "adapter")


def test_rollouts_leave_batch_invariance_off_and_refuse_it_by_name() -> None:
    """The row kernel of batch-invariant mode attends over every key, uncapped: not for Gemma."""
    from pagedrl.train.rl.online import choose_batch_invariance

    cpu = torch.device("cpu")
    assert not choose_batch_invariance(None, True, cpu, layer_rules=True)
    with pytest.raises(ValueError, match="batch_invariant: true is not implemented"):
        choose_batch_invariance(True, True, cpu, layer_rules=True)


def test_sliding_layers_give_back_their_blocks_while_full_layers_keep_theirs() -> None:
    """Gemma 3 (a full layer between two sliding ones over 8 keys) in groups of one layer: the cache holds
    the bytes of its budget; decoding 60 tokens past a 40-token prompt, each sliding group holds at most
    its window and a step's chunk while the full layer's group holds every block, and the greedy tokens
    are transformers' `generate`'s, and one table for every layer's (--disable-hybrid-kv-cache-manager)."""
    hf = hf_model(dict(GEMMA_FAMILIES["gemma3"], max_position_embeddings=256))
    prompt = (prompts(hf.config.vocab_size)[0] * 8)[:40]
    expected = reference(hf, [prompt], max_new=60)
    llm = engine_for(hf, block_size=4, kv_cache_tokens=512, max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.kv_cache.nbytes == 2 * 3 * 512 * 2 * 16 * 4  # (keys and values, 3 layers, 512 tokens, fp32)
    assert engine.kv_layout() == ("384 KV blocks of 4 tokens in float32 and 1 layer each, 3 groups of layers with block tables "
                                  "of their own (1 full; 2 sliding over 8 keys, which give back what left the window)")
    line = footprint(ModelConfig.from_dict(hf.config.to_dict()), torch.float32).describe()
    assert "0.8 KiB of KV cache per token (0.5 KiB of it, the sliding layers', for the last 8 tokens only)" in line
    held: list[tuple[int, ...]] = []
    engine.add_step_observer(lambda e, _: held.extend(
        tuple(g.num_held_blocks(s.seq_id) for g in e.kv_manager.groups) for s in e.scheduler.running))
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert strip_eos(got[0].outputs[0].token_ids) == strip_eos(expected[0])
    one_table = engine_for(hf, block_size=4, kv_cache_tokens=512, max_num_batched_tokens=16,
                           disable_hybrid_kv_cache_manager=True)
    assert not hasattr(one_table.engine.kv_manager, "groups")
    again = one_table.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == got[0].outputs[0].token_ids
    assert held[-1][0] == -(-(len(prompt) + 59) // 4)  # the full layer: every token's block
    assert max(max(h[1:]) for h in held) <= -(-(8 - 1 + 16) // 4) + 1 and held[-1][1] <= 3  # the window's
