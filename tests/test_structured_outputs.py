"""Structured outputs offline: a random tiny model still answers in the shape asked for, because the
grammar's mask is part of the distribution every token is drawn from.

The mask is checked against llguidance replayed independently (a fresh matcher over the output's
tokens), processed log-probs against a dense recompute with that mask, and seeded requests alone
against the same requests in a crowd, under preemption and with n > 1.
"""

from __future__ import annotations

import json
import re

import decoder_bound
import jsonschema_rs
import pytest
import torch
from float_bounds import EXP_ERROR, gamma, logprob_bounds

from pagedrl.engine.grammar import unpack_bitmask
from pagedrl.engine.llm import LLM
from pagedrl.engine.logits_processing import NEG_INF, processed_logprobs
from pagedrl.engine.sampler import Sampler, SamplingRow
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.engine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams
from pagedrl.model.loader import load_model

PROMPTS = ["the cat sat", "what is two plus three", "red green blue yellow"]
SCHEMAS = [
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["color", "n", "ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "role": {"enum": ["admin", "guest"]}}, "required": ["name", "role"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 4}},
     "required": ["user", "scores"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
                                "required": ["k", "v"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


def make_llm(loaded, **engine_args) -> LLM:
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, **engine_args)


@pytest.fixture(scope="module")
def llm(loaded):
    return make_llm(loaded, kv_cache_tokens=4096)


def compact(**kwargs) -> StructuredOutputsParams:
    """No free whitespace: a random model would otherwise spend its budget on blank lines."""
    return StructuredOutputsParams(**kwargs, disable_any_whitespace=True)


def test_json_schema_outputs_parse_and_validate(llm) -> None:
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, structured_outputs=compact(json=schema))
              for schema in SCHEMAS for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp
        validator = jsonschema_rs.validator_for(p.structured_outputs.json)
        assert validator.is_valid(json.loads(comp.text)), comp.text


def test_an_output_cut_by_max_tokens_is_a_valid_prefix(llm) -> None:
    """With free whitespace a random model rarely finishes, but every token it drew is one the
    grammar allowed: an independent matcher accepts the whole output."""
    so = StructuredOutputsParams(json=SCHEMAS[0])
    comp = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=so),
                        use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 12
    matcher = llm.engine.grammar_compiler().matcher(so)
    for t in comp.token_ids:
        matcher.accept(t)  # raises on a token the grammar refuses
    assert comp.text.lstrip().startswith("{")


def test_regex_choice_and_grammars(llm) -> None:
    cases = [
        (compact(regex=r"[0-9]{3}-[a-z]{2}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        (compact(choice=["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")),
        (GuidedDecodingParams(grammar='start: "a" ("b" | "c")~1..4 "d"'),
         lambda text: re.fullmatch(r"a[bc]{1,4}d", text)),
        (compact(grammar='root ::= "x" [0-9] [0-9]? "!"'), lambda text: re.fullmatch(r"x[0-9]{1,2}!", text)),
    ]
    for so, ok in cases:
        for temperature, seed in ((0.0, None), (1.0, 5), (1.3, 6)):
            comp = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, temperature=temperature, seed=seed,
                                                           structured_outputs=so), use_tqdm=False)[0].outputs[0]
            assert comp.finish_reason == "stop" and ok(comp.text), (so, comp.text)


def test_processed_logprobs_are_the_masked_distribution(llm, loaded) -> None:
    """Each sampled token's processed log-prob equals a dense recompute from the model's logits with
    the grammar's mask (replayed by a fresh matcher) and the same temperature and top-p; refused
    tokens are -inf in the reported alternatives, and raw log-probs stay the unmasked model's."""
    so = compact(json=SCHEMAS[1])
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, logprobs=20,
                            logprobs_mode="processed_logprobs", structured_outputs=so)
    prompt = loaded.tokenizer.encode(PROMPTS[2])
    comp = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    model, vocab = loaded.model, llm.vocab_size
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([prompt + comp.token_ids])))[0, len(prompt) - 1:-1].float()
    matcher = llm.engine.grammar_compiler().matcher(so)
    allowed = []
    bits = torch.zeros(llm.engine.grammar_compiler().words, dtype=torch.int32)
    for t in comp.token_ids:
        matcher.fill_bitmask(bits)
        allowed.append(unpack_bitmask(bits[None], vocab)[0].clone())
        matcher.accept(t)
    allowed = torch.stack(allowed)
    tokens = torch.tensor(comp.token_ids)
    dense = processed_logprobs(logits, tokens, temperature=0.8, top_p=0.9, allowed=allowed)
    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    # the engine's and the dense recompute's, within float32's bound of the exact log-probs
    # (`decoder_bound`; infinite where float32 could move the top-p cut, so not all of them)
    exact, bound = decoder_bound.completion_logprobs(model, prompt, comp.token_ids, temperature=0.8, top_p=0.9,
                                                     allowed=allowed)
    assert torch.isfinite(bound).float().mean() >= 0.9
    for got in (torch.tensor(comp.processed_logprobs), dense):
        assert ((got.double() - exact).abs() <= bound).all()
    exact, bound = decoder_bound.completion_logprobs(model, prompt, comp.token_ids)
    for got in (torch.tensor(comp.raw_logprobs), raw):
        assert ((got.double() - exact).abs() <= bound).all()
    for row, entry in enumerate(comp.logprobs):
        for token, lp in entry.items():
            assert bool(allowed[row, token]) or lp.logprob == NEG_INF
    assert (~allowed).any(dim=-1).all()  # every step refused something: the check above had teeth


def test_sampler_mask_renormalises_over_allowed_tokens_only() -> None:
    torch.manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab) * 3
    allowed = torch.rand(3, vocab) < 0.2
    allowed[:, 5] = True
    bits = torch.zeros(3, 3, dtype=torch.int32)
    for r, t in allowed.nonzero().tolist():
        bits[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    assert torch.equal(unpack_bitmask(bits, vocab), allowed)
    params = [SamplingParams(temperature=t, logprobs=vocab, logprobs_mode="processed_logprobs") for t in (0.0, 1.0, 0.5)]
    sampler = Sampler(torch.Generator().manual_seed(0))
    rows = [SamplingRow(params=p, token_bitmask=bits[i]) for i, p in enumerate(params)]
    drawn = torch.zeros(3, vocab, dtype=torch.bool)
    for _ in range(200):
        out = sampler(logits, rows)
        drawn[torch.arange(3), out.token_ids] = True
    assert not (drawn & ~allowed).any()  # a refused token is never drawn
    for i, (top, temperature) in enumerate(zip(out.top_logprobs, (1.0, 1.0, 0.5), strict=True)):  # greedy: unscaled
        values = torch.tensor([top[t] for t in range(vocab)])
        assert torch.isneginf(values[~allowed[i]]).all()
        # float32 log-probs within their bounds, then a float32 exp each and a sum of them
        masked = logits[i:i + 1].double().masked_fill(~allowed[i:i + 1], NEG_INF)
        bound = logprob_bounds(masked, 0.0, temperature)[0][allowed[i]]
        p = torch.softmax(masked[0] / temperature, -1)[allowed[i]]
        n = int(allowed[i].sum())
        assert abs(values[allowed[i]].exp().double().sum() - 1) <= (p * (torch.expm1(bound) + EXP_ERROR)).sum() + gamma(n)
    expected = torch.log_softmax((logits.double() / 0.5).masked_fill(~allowed, NEG_INF), -1)
    bound = logprob_bounds(logits.double().masked_fill(~allowed, NEG_INF), 0.0, 0.5)
    got = torch.tensor([out.top_logprobs[2][t] for t in range(vocab)])
    assert ((got.double() - expected[2])[allowed[2]].abs() <= bound[2][allowed[2]]).all()
    assert int(out.token_ids[0]) == int(logits[0].masked_fill(~allowed[0], NEG_INF).argmax())


def test_seeded_constrained_request_is_batch_invariant_and_survives_preemption(loaded) -> None:
    so = compact(json=SCHEMAS[0])
    seeded = SamplingParams(max_tokens=60, temperature=1.0, seed=42, structured_outputs=so, logprobs=2)
    others = [SamplingParams(max_tokens=25, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.7, seed=3, structured_outputs=compact(choice=["one", "two"])),
              SamplingParams(max_tokens=60, temperature=1.0, seed=9, n=2, structured_outputs=compact(json=SCHEMAS[2]))]
    alone = make_llm(loaded, kv_cache_tokens=4096).generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0]
    crowded_llm = make_llm(loaded, block_size=4, kv_cache_tokens=72, max_num_batched_tokens=16, seed=5)
    crowd = crowded_llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[0]],
                                 [others[0], others[1], others[2], seeded], use_tqdm=False)
    assert crowded_llm.stats()["num_preemptions"] > 0
    got = crowd[3].outputs[0]
    assert got.token_ids == alone.token_ids and got.text == alone.text
    # two float32 computations of the same masked log-probs: within twice the bound of the exact ones
    matcher = crowded_llm.engine.grammar_compiler().matcher(so)
    bits = torch.zeros(crowded_llm.engine.grammar_compiler().words, dtype=torch.int32)
    allowed = []
    for t in got.token_ids:
        matcher.fill_bitmask(bits)
        allowed.append(unpack_bitmask(bits[None], crowded_llm.vocab_size)[0].clone())
        matcher.accept(t)
    _, bound = decoder_bound.completion_logprobs(loaded.model, crowd[3].prompt_token_ids, got.token_ids,
                                                 allowed=torch.stack(allowed))
    assert ((torch.tensor(got.processed_logprobs) - torch.tensor(alone.processed_logprobs)).abs().double()
            <= 2 * bound).all()
    assert crowd[1].outputs[0].text in ("one", "two")
    for comp in crowd[2].outputs:  # n = 2: each fork has its own matcher
        assert comp.finish_reason == "stop" and jsonschema_rs.validator_for(SCHEMAS[2]).is_valid(json.loads(comp.text))
    assert crowd[2].outputs[0].token_ids != crowd[2].outputs[1].token_ids


@pytest.mark.parametrize(("so", "field"), [
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(json={"type": "bogus"}), "structured_outputs.json"),
    (dict(json='{"type": '), "structured_outputs.json"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["a"]), "structured_outputs needs exactly one"),
])
def test_bad_constraints_are_refused_naming_the_field(llm, so, field) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_property_order_is_kept_however_the_compile_cache_is_keyed(llm) -> None:
    """Two schemas that differ only in the order of their properties are different constraints: the
    output writes properties in the schema's order, whichever of the two was compiled first."""
    a = {"type": "object", "properties": {"a": {"enum": ["x"]}, "b": {"enum": ["y"]}}, "required": ["a", "b"],
         "additionalProperties": False}
    b = dict(a, properties=dict(reversed(list(a["properties"].items()))))
    texts = [llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=compact(json=s)),
                          use_tqdm=False)[0].outputs[0].text for s in (a, b)]
    assert texts == ['{"a":"x","b":"y"}', '{"b":"y","a":"x"}']


def test_a_mask_that_leaves_nothing_marks_its_row_not_the_batch() -> None:
    logits = torch.randn(2, 40)
    empty = torch.zeros(2, dtype=torch.int32)
    only_7 = torch.tensor([1 << 7, 0], dtype=torch.int32)
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(logits, [SamplingRow(params=SamplingParams()), SamplingRow(params=SamplingParams(), token_bitmask=empty)])
    assert torch.isfinite(out.processed_logprobs[0]) and torch.isneginf(out.processed_logprobs[1])
    out = sampler(logits, [SamplingRow(params=SamplingParams(), token_bitmask=only_7, banned_token_ids=[7]),
                           SamplingRow(params=SamplingParams(), token_bitmask=only_7)])
    assert torch.isneginf(out.processed_logprobs[0]) and out.token_ids[1] == 7
    out = sampler(logits, [SamplingRow(params=SamplingParams(), token_bitmask=only_7, banned_token_ids=[3])] * 2)
    assert out.token_ids.tolist() == [7, 7] and torch.allclose(out.processed_logprobs, torch.zeros(2))


def test_a_request_whose_settings_refuse_every_token_ends_alone(llm) -> None:
    """A choice whose tokens allowed_token_ids leaves out: that request ends with finish_reason "error"
    saying why, at once; the others in its steps are not touched (it once failed the whole step)."""
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, allowed_token_ids=[5, 6],
                                                  structured_outputs=compact(choice=["ab", "cd"])), request_id="none")
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id="fine")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["none"].finish_reason == "error" and "nothing is left to sample" in finished["none"].error
    assert finished["none"].token_ids == []
    assert finished["fine"].finish_reason == "length" and len(finished["fine"].token_ids) == 8
    assert engine.kv_manager.num_blocks_used == 0


def test_a_grammar_that_fails_mid_way_ends_its_own_request_only(llm) -> None:
    """An llguidance limit hit during generation ends that sequence ("abort"); the others in the
    same step carry on (the step is not failed for everyone)."""
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=compact(regex="[a-z]+")),
                       request_id="broken")
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id="fine")
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=8, structured_outputs=compact(choice=["ab", "cd"])),
                       request_id="other")
    grammar = engine.requests["broken"].seqs[0].grammar

    def fail(row: torch.Tensor) -> None:
        raise RuntimeError("the grammar of structured_outputs.regex failed: lexer fuel exhausted")

    grammar.fill_bitmask = fail
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["broken"].finish_reason == "abort" and finished["broken"].token_ids == []
    assert finished["fine"].finish_reason == "length" and len(finished["fine"].token_ids) == 8
    assert finished["other"].finish_reason == "stop" and finished["other"].text in ("ab", "cd")
    assert engine.kv_manager.num_blocks_used == 0


def test_a_grammar_that_fails_alone_in_its_step_ends_its_request_only(llm) -> None:
    """The same when no other sequence shares the step: nothing is left to sample, and the step
    returns rather than indexing the logits with an empty list."""
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=compact(regex="[a-z]+")),
                       request_id="alone")

    def fail(row: torch.Tensor) -> None:
        raise RuntimeError("the grammar of structured_outputs.regex failed: lexer fuel exhausted")

    engine.requests["alone"].seqs[0].grammar.fill_bitmask = fail
    finished = [out for _ in range(4) if engine.has_unfinished_requests() for out in engine.step() if out.finished]
    assert [(out.request_id, out.outputs[0].finish_reason) for out in finished] == [("alone", "abort")]
    assert not engine.has_unfinished_requests() and engine.kv_manager.num_blocks_used == 0
