"""The engine computes in the precision it is asked for: under `autocast_dtype` its forward runs
under torch.autocast (as a trainer's bf16 autocast runs the same float32 module) and its KV cache
holds that dtype."""

from __future__ import annotations

import decoder_bound
import pytest
import rounding_steps
import torch
from tiny import FAMILIES

from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import products
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


def exact_greedy(model: CausalLM, prompt: list[int], tokens: list[int], precision: decoder_bound.Precision
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For greedy tokens after a prompt: their exact log-probs and the bound of a forward in
    `precision` (`decoder_bound`), the rows whose argmax that precision cannot swap (the top two
    logits further apart than their bounds), and the exact argmax."""
    probed = decoder_bound.logits(model, torch.tensor([prompt + tokens]), precision=precision)
    rows = probed.map(lambda v: v[0, len(prompt) - 1:-1])
    logp, bound = decoder_bound.sampled_logprobs(rows, torch.tensor(tokens))
    top = rows.exact.topk(2, -1)
    decided = top.values[:, 0] - top.values[:, 1] > rows.bound().gather(1, top.indices).sum(-1)
    return logp, bound, decided, top.indices[:, 0]


def test_autocast_dtype_must_be_a_low_precision_float() -> None:
    with pytest.raises(ValueError, match="autocast_dtype"):
        EngineConfig(autocast_dtype=torch.float32).validate()


def test_bf16_autocast_engine_matches_a_dense_forward_under_the_same_autocast() -> None:
    """Greedy tokens and their log-probs equal those of a dense forward under bf16 autocast on the
    same float32 weights, and differ from the float32 engine's log-probs (the autocast is real)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).eval()
    prompts = [torch.randint(3, 211, (n,)).tolist() for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM.from_module(model, kv_cache_tokens=512, autocast_dtype=torch.bfloat16, max_num_batched_tokens=23)
    assert llm.engine.kv_cache.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    outs = llm.generate(prompts, params, use_tqdm=False)
    outside = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        ids = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logp = torch.log_softmax(model.logits(model(ids))[0, len(prompt) - 1:-1].float(), -1)
        exact, bound, decided, argmax = exact_greedy(model, prompt, comp.token_ids, rounding_steps.AUTOCAST)
        chosen = torch.tensor(comp.token_ids)
        assert torch.equal(chosen[decided], argmax[decided]) and torch.equal(logp.argmax(-1)[decided], argmax[decided])
        dense = logp.gather(1, chosen[:, None])[:, 0]
        engine = torch.tensor(comp.processed_logprobs)
        for got in (engine, dense):  # within bf16's bound (~4e-2 here) of the exact autocast log-probs
            assert ((got.double() - exact).abs() <= bound).all()
        plain, plain_bound = decoder_bound.completion_logprobs(model, prompt, comp.token_ids)
        outside = max(outside, float(((engine.double() - plain).abs() - plain_bound).max()))
    assert outside > 0  # the engine is outside float32's bound (~3e-5) of the float32 model: its bf16 is real


def peaked(family: str, seed: int) -> CausalLM:
    """A tiny model whose logits spread as a trained model's do (std ~1.2 rather than ~0.01 at the
    default init), so bf16 rounding is visible in its log-probs."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(FAMILIES[family])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


def test_bf16_engine_matches_a_dense_bf16_forward_of_the_same_module() -> None:
    """A bf16 module (what `dtype="auto"` loads on a CPU with native bf16): the engine's greedy tokens
    are the dense forward's argmax wherever bf16 rounding cannot swap it, its log-probs equal the
    dense ones within bf16 rounding, and they are as close to the float32 model's as the dense bf16
    forward's are (the engine's own CPU kernels round less often than eager bf16 torch: 0.013 against
    0.014 on average here, 0.017 without them); its logits are float32 and its KV cache is bf16 (half
    the bytes of float32)."""
    model = peaked("llama-gqa-untied", 0).to(torch.bfloat16)
    exact = peaked("llama-gqa-untied", 0)
    assert model.model.inv_freq.dtype == torch.float32
    prompts = [torch.randint(3, 211, (n,)).tolist() for n in (4, 21, 40)]
    llm = LLM.from_module(model, kv_cache_tokens=512, max_num_batched_tokens=29)
    assert llm.engine.kv_cache.dtype == torch.bfloat16
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    decisions, engine_error, dense_error = [], [], []
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        ids = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad():
            logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
            exact_logp = torch.log_softmax(exact.logits(exact(ids))[0, len(prompt) - 1:-1], -1)
        assert logits.dtype == torch.float32
        logp = torch.log_softmax(logits, -1)
        rounded, bound, decided, argmax = exact_greedy(model, prompt, comp.token_ids, rounding_steps.BFLOAT16)
        chosen = torch.tensor(comp.token_ids)  # where bf16 rounding cannot swap the argmax: the exact one
        assert torch.equal(chosen[decided], argmax[decided]) and torch.equal(logp.argmax(-1)[decided], argmax[decided])
        engine = torch.tensor(comp.processed_logprobs)
        for got in (engine, logp.gather(1, chosen[:, None])[:, 0]):  # within bf16's bound (~0.4) of exact
            assert ((got.double() - rounded).abs() <= bound).all()
        decisions.append(decided)
        engine_error.append((engine - exact_logp.gather(1, chosen[:, None])[:, 0]).abs())
        dense_error.append((logp - exact_logp).gather(1, chosen[:, None])[:, 0].abs())
    assert torch.cat(decisions).sum() >= 2  # bf16 (~1 on these logits) leaves few argmaxes decided: two
    # A statistic of this CPU's kernels, not a rounding bound: they round less often than eager torch.
    assert torch.cat(engine_error).mean() <= 1.25 * torch.cat(dense_error).mean()


def test_seeded_bf16_sampling_is_batch_invariant() -> None:
    model = peaked("llama-gqa-untied", 1).to(torch.bfloat16)
    prompts = [torch.randint(3, 211, (n,)).tolist() for n in (7, 30, 12, 25)]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=99, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    alone = LLM.from_module(model, kv_cache_tokens=512).generate([prompts[1]], seeded, use_tqdm=False)
    crowd = LLM.from_module(model, kv_cache_tokens=512, max_num_batched_tokens=19, seed=5).generate(
        prompts, [other, seeded, other, other], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_autocast_engine_reads_bf16_copies_refreshed_per_weight_change() -> None:
    """Under autocast the engine runs on a twin that shares the float32 tensors autocast leaves
    alone and holds bf16 copies of the ones it casts: the same numbers, bit for bit, as autocast on
    the masters; an in-place change of the masters (an optimizer step) is copied before the next step."""
    torch.manual_seed(2)
    model = CausalLM(ModelConfig.from_dict(FAMILIES["qwen2-bias-tied"])).eval()
    llm = LLM.from_module(model, kv_cache_tokens=512, autocast_dtype=torch.bfloat16)
    cast = llm.engine.runner.cast
    assert cast is not None and cast.twin is not model and llm.engine.model is model
    twin = cast.twin
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight  # float32, shared
    assert twin.model.norm.weight is model.model.norm.weight
    assert twin.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    projections = sum(p.numel() for n, p in model.named_parameters() if "proj" in n) + model.lm_head.weight.numel()
    assert cast.nbytes == 2 * projections
    ids = torch.randint(3, 211, (1, 23))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(twin.logits(twin(ids)), model.logits(model(ids)))

    prompt = ids[0].tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    before = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.logits(model(ids)).logsumexp(-1).sum().backward()
    optimizer.step()
    llm.bump_weight_version()
    after = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert cast.num_refreshes == 1
    if products.packs_weights():  # a CPU without AMX: the twin's products ran on packed copies
        assert llm.engine.runner.packed is not None and llm.engine.runner.packed.nbytes >= cast.nbytes // 2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp = torch.log_softmax(model.logits(model(torch.tensor([prompt + after.token_ids])))[0, len(prompt) - 1:-1], -1)
    dense = logp.gather(1, torch.tensor(after.token_ids)[:, None])[:, 0]
    exact, bound = decoder_bound.completion_logprobs(model, prompt, after.token_ids, rounding_steps.AUTOCAST)
    for got in (torch.tensor(after.processed_logprobs), dense):  # within bf16's bound of the new weights' exact
        assert ((got.double() - exact).abs() <= bound).all()
    assert not torch.allclose(torch.tensor(before.processed_logprobs), torch.tensor(after.processed_logprobs))


def test_bf16_copies_of_an_adapted_model_follow_the_adapter() -> None:
    """LoRA: the twin holds bf16 copies of the frozen base and of the adapter; an optimizer step on
    the adapter alone refreshes what changed, and switching the adapter off on the master switches
    it off on the twin."""
    from pagedrl.engine.cast_weights import CastWeights
    from pagedrl.model.lora import LoRAConfig, apply_lora, disable_adapter

    torch.manual_seed(3)
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).eval()
    apply_lora(model, LoRAConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["all-linear"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    cast = CastWeights(model, torch.bfloat16)
    ids = torch.randint(3, 211, (1, 17))

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        cast.refresh()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return cast.twin.logits(cast.twin(ids)), model.logits(model(ids))

    twin, master = both()
    assert torch.equal(twin, master)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(lora, lr=0.3)
    model.logits(model(ids)).logsumexp(-1).sum().backward()
    optimizer.step()
    after_twin, after_master = both()
    assert torch.equal(after_twin, after_master) and not torch.equal(after_master, master)
    with disable_adapter(model):
        off_twin, off_master = both()
    assert torch.equal(off_twin, off_master) and not torch.equal(off_master, after_master)
