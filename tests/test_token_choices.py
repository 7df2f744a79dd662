"""A request's token choices (`logit_bias`, `allowed_token_ids`, `bad_words`): their parameters, the
sampler's distribution against a float64 reference written per token, the order against the penalties
(vLLM's), greedy generation against transformers' `sequence_bias` and `bad_words_ids`, and the engine's
checks of a request against its vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from float_bounds import U, log_softmax_bound
from sampler_reference import (
    assert_logprobs_close,
    decided,
    penalty_error,
    random_settings,
    ref_logprobs,
    ref_penalise,
    ref_probs,
)
from test_engine_greedy import engine_for, prompts, reference, strip_eos
from tiny import FAMILIES, hf_model

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampler import Sampler, SamplingRow
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.engine.token_choices import TokenChoices, bad_words_banned, bad_words_token_ids

# ------------------------------------------------------------------ parameters


def test_logit_bias_takes_json_keys_and_clamps_to_openai_range():
    p = SamplingParams(logit_bias={"5": 150, 7: -2.5, "+9": -1000.0})
    assert p.logit_bias == {5: 100.0, 7: -2.5, 9: -100.0}
    assert p.clone(max_tokens=3).logit_bias == p.logit_bias and p.clone().logit_bias is not p.logit_bias


@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"x": 1.0}, "keys"), ("logit_bias", {True: 1.0}, "keys"), ("logit_bias", {-3: 1.0}, "non-negative"),
    ("logit_bias", {"5": 1.0, 5: 2.0}, "twice"), ("logit_bias", {5: float("nan")}, "finite"),
    ("logit_bias", [5, 1.0], "dict"), ("allowed_token_ids", [], "empty"), ("allowed_token_ids", [1, -2], "non-negative"),
    ("allowed_token_ids", [1.0], "list of int"), ("bad_words", [" "], "blank"), ("bad_words", [3], "str"),
])
def test_bad_token_choices_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}.*{words}"):
        SamplingParams(**{field: value})


# ------------------------------------------------------------------ the sampler against float64


def test_choices_then_penalties_match_the_reference_distribution():
    """Random rows with a bias, an allowed set on every other row, penalties on every third: the
    processed distribution against float64 (bias and allowed set first, then vLLM's penalty formulas),
    raw log-probs untouched, and every drawn token inside the allowed set."""
    gen = torch.Generator().manual_seed(11)
    vocab, n = 12, 24
    logits = torch.randn(n, vocab, generator=gen) * 2
    rows, cases = [], []
    for i in range(n):
        s = random_settings(gen, vocab) if i % 4 else dict(temperature=0.0)
        bias = {i % vocab: 3.0, (i + 4) % vocab: -2.5, (i + 7) % vocab: -100.0}
        allowed = sorted({(i + k) % vocab for k in (0, 2, 4, 5, 7, 9)}) if i % 2 else None
        pen = dict(presence_penalty=0.3, frequency_penalty=-0.2, repetition_penalty=1.4) if i % 3 == 0 else {}
        prompt, output = [i % vocab, 3], [1, 1, (2 * i) % vocab]
        params = SamplingParams(**s, **pen, logit_bias=bias, allowed_token_ids=allowed,
                                logprobs=vocab, logprobs_mode="processed_logprobs")
        rows.append(SamplingRow(params, prompt, output))
        biased = [x + bias.get(t, 0.0) if allowed is None or t in allowed else -math.inf
                  for t, x in enumerate(logits[i].double().tolist())]
        penalties = (pen.get("presence_penalty", 0.0), pen.get("frequency_penalty", 0.0),
                     pen.get("repetition_penalty", 1.0))
        penalised = ref_penalise(biased, prompt, output, *penalties)
        finite = [x if x > -math.inf else 0.0 for x in biased]
        scale = max(penalties[2], 1 / penalties[2])
        # the bias's rounding, scaled by the repetition penalty, then the penalty's own
        error = [e + 2 * U * abs(x) * scale for e, x in
                 zip(penalty_error(finite, prompt, output, *penalties), finite, strict=True)]
        cases.append((ref_probs(penalised, **s)[0], penalised, error, s, allowed))
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    raw = torch.log_softmax(logits.double(), -1)
    checked = 0
    for i, (expected, penalised, error, s, allowed) in enumerate(cases):
        tok = int(out.token_ids[i])
        assert expected[tok] > 0 and (allowed is None or tok in allowed)
        assert abs(out.raw_logprobs[i].item() - raw[i, tok].item()) <= log_softmax_bound(logits[i:i + 1],
                                                                                          out.token_ids[i:i + 1])
        if s["temperature"] == 0.0:
            assert tok == max(range(vocab), key=lambda t: penalised[t])
        if decided(penalised, **s, error=error):
            checked += 1
            dist = [out.top_logprobs[i].get(t, -math.inf) for t in range(vocab)]
            assert_logprobs_close(dist, ref_logprobs(expected), penalised, s["temperature"], error)
    assert checked > 18


def test_the_bias_comes_before_the_repetition_penalty_as_in_vllm():
    # token 0: logit 1 + bias 2 = 3, seen in the prompt, / repetition 2 = 1.5 < token 1's 2.0; the other
    # order (1 / 2 + 2 = 2.5) would pick token 0
    logits = torch.tensor([[1.0, 2.0, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, logit_bias={0: 2.0}, repetition_penalty=2.0), [0])
    assert Sampler()(logits, [row]).token_ids.tolist() == [1]
    alone = SamplingRow(SamplingParams(temperature=0.0, logit_bias={0: 2.0}), [0])
    assert Sampler()(logits, [alone]).token_ids.tolist() == [0]


def test_an_allowed_set_with_bans_that_leaves_nothing_marks_its_row():
    row = SamplingRow(SamplingParams(allowed_token_ids=[2, 3]), banned_token_ids=[2, 3])
    out = Sampler()(torch.zeros(2, 5), [row, SamplingRow(SamplingParams(allowed_token_ids=[2, 3]))])
    assert torch.isneginf(out.processed_logprobs[0]) and out.token_ids[1] in (2, 3)


# ------------------------------------------------------------------ bad words


def test_a_bad_word_bans_its_last_token_once_the_output_holds_the_rest():
    words = [[5], [7, 8, 9], [8, 4]]
    assert bad_words_banned(words, []) == [5]
    assert bad_words_banned(words, [1, 7]) == [5]
    assert bad_words_banned(words, [1, 7, 8]) == [5, 9, 4]
    assert bad_words_banned(words, [7, 8, 1]) == [5]


def test_bad_words_tokenize_at_a_text_start_and_after_a_space(default_tokenizer):
    tok = default_tokenizer
    (paris,) = [tok.encode(w, add_special_tokens=False) for w in ["Paris"]]
    spaced = tok.encode(" Paris", add_special_tokens=False)
    assert paris != spaced and len(paris) == len(spaced)  # SmolLM2's BPE has a word-initial token
    assert bad_words_token_ids(["Paris"], tok) == [paris, spaced]
    assert bad_words_token_ids([" Paris"], tok) == [paris, spaced]  # a leading space is not part of the word
    with pytest.raises(ValueError, match="tokenizer"):
        bad_words_token_ids(["Paris"], None)


# ------------------------------------------------------------------ against transformers


@pytest.fixture(scope="module")
def tiny():
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    batch = prompts(hf.config.vocab_size, seed=3)
    return hf, batch, reference(hf, batch)


def test_greedy_with_logit_bias_matches_transformers_sequence_bias(tiny):
    hf, batch, plain = tiny
    firsts = sorted({out[0] for out in plain})
    # push each prompt's first greedy token down, and one token up just enough to win somewhere
    bias = {**{t: -4.0 for t in firsts}, 7: 3.5}
    expected = reference(hf, batch, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert expected != plain
    llm = engine_for(hf, kv_cache_tokens=2048)
    got = [o.outputs[0].token_ids for o in llm.generate(
        batch, SamplingParams(temperature=0.0, max_tokens=12, logit_bias=bias), use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected]


def test_greedy_with_bad_words_matches_transformers_bad_words_ids(default_model_dir, default_tokenizer):
    """The default model asked for France's capital with "Paris" and "capital of" banned (words of its
    own answer, tokenized by the engine's rule): the same tokens as transformers' `bad_words_ids` given
    those token sequences, and neither word in the answer."""
    import transformers

    tok = default_tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    batch = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    plain = reference(hf, batch, max_new=12)
    words = ["Paris", "capital of"]
    sequences = bad_words_token_ids(words, tok)
    assert all(w in tok.decode(plain[0]) for w in words)  # "The capital of France is Paris."
    # transformers also matches a word begun in the prompt, vLLM's rule only one begun in the output
    assert not any(len(w) > 1 and p[-len(w) + 1:] == w[:-1] for w in sequences for p in batch)
    expected = reference(hf, batch, max_new=12, bad_words_ids=sequences)
    llm = LLM(str(default_model_dir), dtype="float32", kv_cache_tokens=1024)
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=12, bad_words=words), use_tqdm=False)
    eos = llm.engine.eos_token_ids[0]
    assert [strip_eos(o.outputs[0].token_ids, eos) for o in outs] == [strip_eos(e, eos) for e in expected]
    for o in outs:
        assert "Paris" not in o.outputs[0].text and "capital of" not in o.outputs[0].text


# ------------------------------------------------------------------ the engine's checks


def test_the_engine_refuses_choices_outside_its_vocabulary():
    choices = TokenChoices(50, None, [2])
    for params, words in ((SamplingParams(logit_bias={50: 1.0}), "logit_bias .*outside"),
                          (SamplingParams(allowed_token_ids=[3, 99]), "allowed_token_ids .*outside"),
                          (SamplingParams(bad_words=["x"]), "bad_words needs the model's tokenizer"),
                          (SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1),
                           "all stop tokens")):
        with pytest.raises(ValueError, match=words):
            choices.check(params)
    choices.check(SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1, ignore_eos=True))


def test_min_tokens_with_a_stop_id_outside_the_vocabulary_runs(tiny):
    # any id may stop a request; one the model never draws needs no ban (it once broke the step)
    hf, batch, plain = tiny
    llm = engine_for(hf, kv_cache_tokens=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=[10**6]),
              SamplingParams(temperature=0.0, max_tokens=12)]
    got = [o.outputs[0].token_ids for o in llm.generate(batch[:2], params, use_tqdm=False)]
    assert strip_eos(got[1]) == strip_eos(plain[1]) and len(got[0]) >= 3
