"""Adapters chosen per request on a mixture of experts' stacked weights (`engine/expert_slots.py`): the
base and two expert adapters (one on the experts only, one of another rank on attention projections and
one expert weight) side by side in the same steps, each request with the greedy tokens and log-probs of
its adapter merged into the weights, on Mixtral, Qwen3-MoE, gpt-oss and DeepSeek-V3; what does not fit
is refused by name; a server loads such an adapter at start-up and answers the `openai` client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from multi_lora_cases import merged_greedy, rewrite_adapter
from server_process import running_server
from test_expert_lora import ALL, EXPERTS, moe_folder
from test_multi_lora import record_steps
from tiny import hf_model, ours_from, randomise_adapter

from pagedrl import LoRARequest
from pagedrl.engine.llm import LLM
from pagedrl.engine.multi_lora import read_lora
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import save_adapter
from pagedrl.model.checkpoint import save_checkpoint
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
# Experts alone at rank 4; attention and the down weight alone at rank 2 (gate/up left bare).
ADAPTERS = {"experts4": dict(r=4, target_parameters=EXPERTS),
            "mixed2": dict(r=2, target_modules=["o_proj"], target_parameters=["mlp.experts.down_proj"])}


def expert_adapter(base: Path, folder: Path, seed: int, r: int, target_modules: list[str] | None = None,
                   target_parameters: list[str] = EXPERTS) -> Path:
    """An adapter on `base`'s experts as a pagedrl trainer saves it (PEFT's names), B drawn large enough to
    change the tokens."""
    model = load_model(base, device="cpu", dtype=torch.float32).model
    apply_lora(model, LoRAConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=target_modules,
                                 target_parameters=target_parameters), torch.Generator().manual_seed(seed))
    randomise_adapter(model, seed + 100, scale=0.5)
    return save_adapter(model, folder)


def adapters_on(base: Path, root: Path) -> dict[str, Path]:
    return {name: expert_adapter(base, root / name, seed, **kw) for seed, (name, kw) in enumerate(ADAPTERS.items())}


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_expert_adapters_and_the_base_in_one_batch_give_their_merged_checkpoints_tokens(tmp_path, family) -> None:
    save_checkpoint(ours_from(hf_model(ALL[family])), tmp_path / "base")
    adapters = adapters_on(tmp_path / "base", tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 19, 40)]
    want = {}
    for name, folder in [(None, None), *adapters.items()]:
        llm = LLM(str(tmp_path / "base"), adapter=None if folder is None else str(folder), dtype=torch.float32,
                  kv_cache_tokens=1024)
        want[name] = tokens_and_logprobs(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert len({str([t for t, _ in w]) for w in want.values()}) == 3  # each adapter changes the tokens

    llm = LLM(str(tmp_path / "base"), dtype=torch.float32, kv_cache_tokens=1024, enable_lora=True, max_loras=2,
              max_lora_rank=4)
    steps = record_steps(llm)
    loras = {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(adapters.items())}
    keys = [(name, i) for i in range(len(prompts)) for name in (None, *loras)]
    outs = llm.generate([prompts[i] for _, i in keys], GREEDY, use_tqdm=False,
                        lora_request=[None if name is None else loras[name] for name, _ in keys])
    for (name, i), (tokens, logprobs) in zip(keys, tokens_and_logprobs(outs), strict=True):
        assert tokens == want[name][i][0], (name, i)
        assert max(abs(a - b) for a, b in zip(logprobs, want[name][i][1], strict=True)) < 1e-4, (name, i)
    assert any(None in step and len(set(step)) == 3 for step in steps)  # the base and both adapters together
    stacks = next(iter(llm.engine.lora.experts.values())).stacks
    assert set(stacks) == {"gate_up_proj", "down_proj"}  # made at the first adapter of each weight


def test_expert_stacks_are_made_for_the_weights_an_adapter_adapts_only(tmp_path) -> None:
    save_checkpoint(ours_from(hf_model(ALL["mixtral"])), tmp_path / "base")
    llm = LLM(str(tmp_path / "base"), dtype=torch.float32, kv_cache_tokens=512, enable_lora=True, max_lora_rank=4)
    before = llm.engine.lora.nbytes
    folder = expert_adapter(tmp_path / "base", tmp_path / "down", 0, 2, target_parameters=["mlp.experts.down_proj"])
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("down", 1, str(folder)))
    stacks = next(iter(llm.engine.lora.experts.values())).stacks
    assert set(stacks) == {"down_proj"} and llm.engine.lora.nbytes > before


def test_expert_adapters_that_do_not_fit_are_refused_by_name(tmp_path) -> None:
    save_checkpoint(ours_from(hf_model(ALL["mixtral"])), tmp_path / "base")
    good = expert_adapter(tmp_path / "base", tmp_path / "good", 0, 4)
    llm = LLM(str(tmp_path / "base"), dtype=torch.float32, kv_cache_tokens=512, enable_lora=True, max_lora_rank=2)

    ids = iter(range(1, 10))

    def refused(name: str, folder: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, next(ids), str(folder)))

    refused("good", good, r"LoRA adapter 'good' .*rank 4 exceeds max_lora_rank 2")
    small = expert_adapter(tmp_path / "base", tmp_path / "small", 1, 2)
    six = rewrite_adapter(small, tmp_path / "six", lambda n, t: t[: 2 * 6] if n.endswith("lora_A.weight") else t)
    refused("six", six, r"'six' .*mlp.experts.(gate_up|down)_proj has lora_A \(12, .*8 experts need \(16, ")

    def nan_in_experts_b(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith("layers.1.mlp.experts.lora_B.weight"):
            t = t.clone()
            t[0, 0] = float("nan")
        return t

    bad = rewrite_adapter(small, tmp_path / "bad", nan_in_experts_b)
    refused("bad", bad, r"'bad' .*layers.1.mlp.experts.down_proj' lora_B holds 1 NaN")
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("small", next(ids), str(small)))
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens  # one that fits serves
    # Experts without stacked float weights (a GGUF file's, kept quantized) take none.
    with pytest.raises(ValueError, match=r"'small' .*experts whose weights this base model does not hold as stacked"):
        read_lora(LoRARequest("small", 1, str(small)), dict(llm.engine.lora.layers), 4, torch.float32, experts={})


def test_the_server_loads_an_expert_adapter_at_start_and_answers_the_openai_client(tmp_path) -> None:
    from pagedrl.model.tokenizer import Tokenizer

    base = moe_folder(tmp_path / "moe", "Qwen3MoeForCausalLM")
    adapter = expert_adapter(base, tmp_path / "mixed", 2, 2, ["q_proj", "v_proj"])
    prompts = ["the cat sat on the mat", "what is two plus three"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokenizer = Tokenizer.from_folder(base)
    texts = {name: [tokenizer.decode(t) for t in tokens]
             for name, tokens in merged_greedy(base, {"mixed": adapter}, prompts, params).items()}
    with running_server(base, tmp_path, "--kv-cache-tokens", "1024", "--served-model-name", "base",
                        "--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"mixed={adapter}") as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data][:2] == ["base", "mixed"]
        for name in (None, "mixed"):
            for prompt, want in zip(prompts, texts[name], strict=True):
                out = client.completions.create(model=name or "base", prompt=prompt, max_tokens=params.max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True})
                assert out.choices[0].text == want, (name, prompt)


class Host:
    """What `ExpertSlots` reads of the engine's `LoRASlots`: the limits, the dtype and the running step."""

    max_loras, max_lora_rank, dtype, device, step = 3, 3, torch.float32, torch.device("cpu"), None


@pytest.mark.parametrize("mix", ["even", "skewed"])
def test_each_row_takes_its_own_slots_expert_update_and_a_nan_stays_in_its_slot(mix) -> None:
    """The split against the experts with each slot's update merged into the weights, token by token; even
    groups use the stacks as they lie, skewed ones gather each entry's weights (`Grouped`)."""
    from pagedrl.engine.expert_slots import ExpertSlots
    from pagedrl.engine.lora_step import BASE, StepSlots
    from pagedrl.model.moe import Experts

    g = torch.Generator().manual_seed(0)
    experts = Experts(4, 16, 8)
    host = Host()
    slots = ExpertSlots(experts, host)
    pairs = {}  # slot → weight → (Aᵀ [E, in, r], (s·B)ᵀ [E, r, out])
    for slot, rank, weights in ((0, 3, ("gate_up_proj", "down_proj")), (2, 2, ("down_proj",))):
        pairs[slot] = {w: (torch.randn(4, slots.features[w][0], rank, generator=g),
                           torch.randn(4, rank, slots.features[w][1], generator=g) * 0.3) for w in weights}
        slots.load(slot, pairs[slot], rank)
    kinds = [BASE, 0, 2, 1] if mix == "even" else [0] * 9 + [2, BASE]  # slot 1 holds no adapter
    token_slot = torch.tensor([kinds[i % len(kinds)] for i in range(44)])
    host.step = StepSlots.plan(token_slot, host.device)
    x = torch.randn(44, 16, generator=g)
    chosen = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(44)])
    weights = torch.rand(44, 2, generator=g)
    split, seen = slots.split, []
    slots.split = lambda *args: seen.append(split(*args)) or seen[-1]
    with torch.no_grad():
        got = experts(x, chosen, weights)
    assert set(seen[0].plans) == {"gate_up_proj", "down_proj"}
    assert (seen[0].plans["down_proj"].entry_slot is not None) == (mix == "skewed")
    with torch.no_grad():
        for slot in token_slot.unique().tolist():
            merged = Experts(4, 16, 8)
            merged.load_state_dict(experts.state_dict())
            for w, (a, bt) in pairs.get(slot, {}).items():
                getattr(merged, w).add_(torch.bmm(a, bt).transpose(1, 2))  # ΔW [E, out, in]
            rows = token_slot == slot
            assert torch.allclose(got[rows], merged(x[rows], chosen[rows], weights[rows]), atol=1e-5), slot
        slots.stacks["down_proj"][0][2 * 4 + 1, 0, 0] = float("nan")  # slot 2's expert 1
        poisoned = experts(x, chosen, weights)
    hit = (token_slot == 2) & (chosen == 1).any(-1)
    assert hit.any() and poisoned[hit].isnan().all()
    assert torch.equal(poisoned[~hit], got[~hit])
