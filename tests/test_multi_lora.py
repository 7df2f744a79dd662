"""Many adapters in one engine (`LLM(enable_lora=True)`): a batch mixing the base and three adapters of
different ranks runs in the same steps and gives, per request, the greedy tokens of that adapter's
merged checkpoint; fewer slots than adapters evict and reload without changing a token; prefix hits
never cross adapters; adapters that do not fit, or hold NaN, are refused by name, and a NaN that gets
into a slot anyway reaches none of the step's other requests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from multi_lora_cases import (
    GREEDY,
    MAX_RANK,
    PROMPTS,
    make_adapters,
    merged_greedy,
    nan_in_first_lora_a,
    rewrite_adapter,
)

from pagedrl import LoRARequest
from pagedrl.engine import multi_lora
from pagedrl.engine.llm import LLM
from pagedrl.engine.lora_step import BASE, StepSlots
from pagedrl.engine.multi_lora import LoRASlots
from pagedrl.engine.outputs import CompletionOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import save_adapter
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.lora import LoRAConfig, apply_lora

ORDER = [None, "qv2", "all4", "peft8"]


@pytest.fixture(scope="module")
def adapters(tiny_train_model, tmp_path_factory) -> dict[str, Path]:
    return make_adapters(tiny_train_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def merged(tiny_train_model, adapters) -> dict[str | None, list[list[int]]]:
    return merged_greedy(tiny_train_model, adapters)


def requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(adapters.items())}


def mixed_batch(adapters: dict[str, Path]) -> tuple[list[str], list[LoRARequest | None], list[tuple[str | None, int]]]:
    """Every prompt under the base and each adapter, interleaved."""
    loras = requests(adapters)
    prompts, chosen, keys = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for name in ORDER:
            prompts.append(prompt)
            chosen.append(None if name is None else loras[name])
            keys.append((name, i))
    return prompts, chosen, keys


def record_steps(llm: LLM) -> list[list[int | None]]:
    """The adapter ids of every step's sequences, as the runner receives them."""
    steps: list[list[int | None]] = []
    slots = llm.engine.lora
    begin = slots.begin_step

    def spy(seqs, num_new_tokens):
        steps.append([None if s.lora is None else s.lora.lora_int_id for s in seqs])
        return begin(seqs, num_new_tokens)

    slots.begin_step = spy
    return steps


@pytest.mark.parametrize("max_loras", [3, 2])
def test_a_mixed_batch_gives_each_request_its_merged_checkpoints_tokens(tiny_train_model, adapters, merged,
                                                                        max_loras) -> None:
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=2048, enable_lora=True,
              max_loras=max_loras, max_lora_rank=MAX_RANK)
    steps = record_steps(llm)
    prompts, chosen, keys = mixed_batch(adapters)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=chosen)
    for out, (name, i) in zip(outs, keys, strict=True):
        assert out.outputs[0].token_ids == merged[name][i], (name, i)
    running = [len({a for a in step if a is not None}) for step in steps]
    assert max(running) == max_loras  # adapters side by side in one step, never more than the slots
    assert any(None in step and len(set(step)) == max_loras + 1 for step in steps)  # the base among them
    if max_loras == 3:
        assert llm.engine.lora.num_slot_loads == 3
        assert len(steps) == GREEDY.max_tokens  # one batch: the whole run took the steps of one request
    else:  # the third adapter waited for a slot, then took the least recently used one
        assert llm.engine.lora.num_slot_loads == 3
        assert len(steps) == 2 * GREEDY.max_tokens


def test_slots_and_cpu_copies_evict_and_reload_without_changing_a_token(tiny_train_model, adapters, merged) -> None:
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=2048, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=MAX_RANK)
    loras = requests(adapters)
    for _ in range(2):  # each round reads every adapter from disk again (one CPU copy kept)
        for name in ("qv2", "all4", "peft8"):
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras[name])
            assert [o.outputs[0].token_ids for o in outs] == merged[name]
    assert llm.engine.lora.num_slot_loads == 6
    assert list(llm.engine.lora.cpu) == [loras["peft8"].lora_int_id]
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] == merged[None]


def test_prefix_hits_never_cross_adapters(tiny_train_model, adapters) -> None:
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=2048, block_size=4, enable_lora=True,
              max_loras=2, max_lora_rank=MAX_RANK)
    loras = requests(adapters)
    prompt = " ".join(PROMPTS)  # several blocks of 4 tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def hits_after(lora: LoRARequest | None, salt: str | None = None) -> int:
        before = llm.stats()["prefix_cache_hits"]
        llm.generate({"prompt": prompt, "cache_salt": salt} if salt else prompt, params, use_tqdm=False,
                     lora_request=lora)
        return llm.stats()["prefix_cache_hits"] - before

    assert hits_after(loras["qv2"]) == 0
    assert hits_after(loras["all4"]) == 0  # same tokens, another adapter: nothing shared
    assert hits_after(None) == 0  # nor with the base
    assert hits_after(loras["qv2"]) > 0  # the same adapter again finds its own blocks
    assert hits_after(None) > 0
    # a request's cache_salt (vLLM's) is mixed in beside the adapter's: neither alone finds the pair's blocks
    assert hits_after(loras["qv2"], "s") == 0 and hits_after(None, "s") == 0 and hits_after(loras["all4"], "s") == 0
    assert hits_after(loras["qv2"], "s") > 0 and hits_after(None, "s") > 0


def test_adapters_that_do_not_fit_are_refused_by_name(tiny_train_model, adapters, tmp_path) -> None:
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=512, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"'peft8' .*rank 8 exceeds max_lora_rank 4"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("peft8", 1, str(adapters["peft8"])))
    # an adapter of another base model: its projections have other shapes
    other = CausalLM(ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=32,
                                                intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, max_position_embeddings=64)))
    apply_lora(other, LoRAConfig(r=2))
    save_adapter(other, tmp_path / "other")
    with pytest.raises(ValueError, match=r"'other' .*q_proj' has lora_A \(2, 32\).*needs \(2, 64\)"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 2, str(tmp_path / "other")))
    with pytest.raises(ValueError, match=r"'missing': .*no such folder"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 3, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="lora_int_id 4 already names adapter 'qv2'"):
        llm.generate(["hello", "hi"], GREEDY, use_tqdm=False,
                     lora_request=[LoRARequest("qv2", 4, str(adapters["qv2"])),
                                   LoRARequest("all4", 4, str(adapters["all4"]))])
    assert not llm.engine.has_unfinished_requests()  # a refused call leaves nothing queued
    plain = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=512)
    with pytest.raises(ValueError, match="without enable_lora"):
        plain.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("qv2", 1, str(adapters["qv2"])))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/x")


def test_full_modules_and_a_module_training_owns_are_refused(tiny_train_model, tmp_path) -> None:
    model = CausalLM(ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
                                                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, max_position_embeddings=64)))
    apply_lora(model, LoRAConfig(r=2, modules_to_save=["lm_head"]))
    save_adapter(model, tmp_path / "with_head")
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=512, enable_lora=True)
    with pytest.raises(ValueError, match=r"'with_head' .*modules_to_save \['lm_head'\]"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("with_head", 1, str(tmp_path / "with_head")))
    with pytest.raises(ValueError, match="a module training owns"):
        LLM.from_module(model, enable_lora=True)


def test_adapters_with_nan_or_infinite_numbers_are_refused_by_name(tiny_train_model, adapters, tmp_path) -> None:
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=512, enable_lora=True, max_lora_rank=MAX_RANK)
    good = adapters["qv2"]
    broken = {
        "nan_a": (rewrite_adapter(good, tmp_path / "nan_a", nan_in_first_lora_a),
                  r"'nan_a' .*q_proj' lora_A holds 1 NaN or infinite values"),
        "inf_b": (rewrite_adapter(good, tmp_path / "inf_b", lambda n, t: t * math.inf if "lora_B" in n else t),
                  r"'inf_b' .*lora_B holds \d+ NaN or infinite values"),
        "nan_alpha": (rewrite_adapter(good, tmp_path / "nan_alpha", lora_alpha=math.nan),
                      r"'nan_alpha': .*lora_alpha: must be a finite number > 0, got nan"),
        "inf_alpha": (rewrite_adapter(good, tmp_path / "inf_alpha", lora_alpha=math.inf),
                      r"'inf_alpha': .*lora_alpha: must be a finite number > 0, got inf"),
        "nan_r": (rewrite_adapter(good, tmp_path / "nan_r", r=math.nan), r"'nan_r': .*lora_r: must be an integer"),
        "overflow": (rewrite_adapter(good, tmp_path / "overflow", lora_alpha=1e300),
                     r"'overflow' .*overflows torch.float32 once lora_B is scaled by lora_alpha / r = 5e\+299"),
    }
    for i, (name, (folder, reason)) in enumerate(broken.items()):
        with pytest.raises(ValueError, match=reason):
            llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(folder)))
    assert not llm.engine.has_unfinished_requests() and llm.engine.lora.num_slot_loads == 0


def test_a_nan_in_a_resident_slot_reaches_none_of_the_other_requests(tiny_train_model, adapters, merged,
                                                                     caplog) -> None:
    """The load check is passed by: a NaN written into a slot's weights. The base's and the other
    adapters' requests of the same steps get the same tokens and log-probs; the poisoned adapter's own
    requests end with finish_reason "error", naming it, each with one warning."""
    llm = LLM(str(tiny_train_model), dtype=torch.float32, kv_cache_tokens=2048, enable_lora=True, max_loras=3,
              max_lora_rank=MAX_RANK, enable_prefix_caching=False)
    loras = requests(adapters)
    for name in ("qv2", "all4", "peft8"):  # slots 0, 1 and 2
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=loras[name])
    names = [None, "qv2", "peft8"]
    batch = [(name, i) for i, _ in enumerate(PROMPTS) for name in names]

    def run(keys: list[tuple[str | None, int]]) -> dict[tuple[str | None, int], CompletionOutput]:
        outs = llm.generate([PROMPTS[i] for _, i in keys], GREEDY, use_tqdm=False,
                            lora_request=[None if name is None else loras[name] for name, _ in keys])
        return {key: out.outputs[0] for key, out in zip(keys, outs, strict=True)}

    clean = run(batch)
    slots = llm.engine.lora
    slot, rank = slots.resident.index(loras["all4"].lora_int_id), slots.max_lora_rank
    layers = slots.layers
    with torch.no_grad():  # one NaN on each side of the product: in an A and in a (s·B)ᵀ
        layers["model.layers.0.self_attn.q_proj"].lora_a[slot * rank, 0] = math.nan
        layers["model.layers.1.mlp.down_proj"].lora_bt[slot * rank, 0] = math.nan
    idle = run(batch)  # its slot lies between the two the step uses
    assert slots.num_slot_loads == 3
    beside = run(batch + [("all4", i) for i, _ in enumerate(PROMPTS)])  # its requests in the same steps
    for key in batch:
        want = clean[key]
        assert want.token_ids == merged[key[0]][key[1]], key
        # the very same steps: the very same numbers
        assert (idle[key].token_ids, idle[key].processed_logprobs, idle[key].raw_logprobs) == \
            (want.token_ids, want.processed_logprobs, want.raw_logprobs), key
        # steps with the poisoned adapter's rows too (fewer after the first): the same up to float rounding
        out = beside[key]
        assert out.token_ids == want.token_ids and out.finish_reason == "length", key
        assert out.processed_logprobs == pytest.approx(want.processed_logprobs, abs=1e-5), key
        assert out.raw_logprobs == pytest.approx(want.raw_logprobs, abs=1e-5), key
    for i, _ in enumerate(PROMPTS):
        out = beside[("all4", i)]
        assert out.finish_reason == "error" and out.token_ids == [] and out.text == ""
        assert "with LoRA adapter 'all4' are NaN or infinite at output token 0" in out.error
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "ended:" in r.getMessage()]
    assert len(warned) == len(PROMPTS) and all("'all4'" in r.getMessage() for r in warned)


@pytest.mark.parametrize("token_slot", [
    [0, 1, 2, 3, 0, 0, BASE, 2],  # decode: grouped, about even, one entry per slot
    [BASE, BASE, 3, 3, 3],  # one adapter beside the base
    [0, 3],  # slots 1 and 2 in the range, without tokens
    [0, 1] * 10 + [0] * 20 + [2, 3],  # one group much longer: split into entries
    [BASE] * 5 + [3, 0] * 15 + [3] * 10,  # ... and the range's empty slots left out
    [1] * 40 + [0, 2, BASE, 3],  # a prompt's run, in place, beside grouped decode tokens
    [BASE] * 3 + [2] * 33 + [1] * 2 + [2] * 5 + [0] * 32,  # runs and a grouped rest of the same slots
])
@pytest.mark.parametrize("scratch_from", [0, 1 << 30])  # the buffers kept across calls, or fresh ones
def test_each_token_gets_its_own_slots_update_and_nothing_from_another_slot(token_slot, scratch_from,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(multi_lora, "SCRATCH_MIN_NUMEL", scratch_from)
    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(8, 5)
    slots = LoRASlots(model, max_loras=4, max_lora_rank=3)
    layer, g = slots.layers["q_proj"], torch.Generator().manual_seed(0)
    layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=g))
    layer.lora_bt.copy_(torch.randn(layer.lora_bt.shape, generator=g))
    layer.ranks = [3] * 4
    x = torch.randn(len(token_slot), 8, generator=g)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.base.weight, layer.base.bias)
        for t, s in enumerate(token_slot):
            if s != BASE:
                want[t] += x[t] @ layer.lora_a[3 * s:3 * s + 3].t() @ layer.lora_bt[3 * s:3 * s + 3]
        slots.step = StepSlots.plan(torch.tensor(token_slot), torch.device("cpu"))
        got = model.q_proj(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        for stack in (layer.lora_a, layer.lora_bt):
            for poisoned in range(4):
                kept = stack.clone()
                stack[3 * poisoned + 1, 2] = math.nan
                again = model.q_proj(x)
                stack.copy_(kept)
                for t, s in enumerate(token_slot):
                    if s == poisoned:
                        assert again[t].isnan().any()
                    else:
                        assert torch.equal(again[t], got[t]), (poisoned, t)
