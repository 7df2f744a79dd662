"""Many adapters in one engine (`LLM(enable_lora=True)`): a batch mixing the base and three adapters of
different ranks runs in the same steps and gives, per request, the greedy tokens of that adapter's
merged checkpoint; fewer slots than adapters evict and reload without changing a token; prefix hits
never cross adapters; adapters that do not fit are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multi_lora_cases import GREEDY, MAX_RANK, PROMPTS, make_adapters, merged_greedy

from pagedrl import LoRARequest
from pagedrl.engine.llm import LLM
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

    def hits_after(lora: LoRARequest | None) -> int:
        before = llm.stats()["prefix_cache_hits"]
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return llm.stats()["prefix_cache_hits"] - before

    assert hits_after(loras["qv2"]) == 0
    assert hits_after(loras["all4"]) == 0  # same tokens, another adapter: nothing shared
    assert hits_after(None) == 0  # nor with the base
    assert hits_after(loras["qv2"]) > 0  # the same adapter again finds its own blocks
    assert hits_after(None) > 0


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
