"""`echo` with prompt log-probs on /v1/completions, `/tokenizer_info` and `/version`, from a real
`pagedrl serve` process: what log-likelihood evaluations (lm-evaluation-harness's multiple-choice tasks
through `local-completions`) ask of a vLLM server. The reference is `LLM.generate`'s prompt log-probs
in this process."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import running_server

import pagedrl
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model

PROMPT = "the cat sat on the mat"
# A small multiple-choice task in lm-eval's shape: a context, continuations, the gold one.
TASK = [
    {"context": "the cat sat on the", "choices": [" mat", " park", " five"], "gold": 0},
    {"context": "what is two plus", "choices": [" three", " blue", " mat"], "gold": 0},
    {"context": "one two three four", "choices": [" yellow", " five", " dog"], "gold": 1},
    {"context": "red green blue", "choices": [" yellow", " there", " cat"], "gold": 0},
    {"context": "a dog ran in the", "choices": [" answer", " park", " six"], "gold": 1},
]


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-echo"), "--kv-cache-tokens", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=4096)


def reference_prompt_logprobs(offline: LLM, prompt) -> list[float | None]:
    out = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [None if e is None else e[t].logprob for t, e in zip(out.prompt_token_ids, out.prompt_logprobs,
                                                                strict=True)]


@pytest.mark.parametrize("prompt", [PROMPT, " and ".join([PROMPT] * 4)])
def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(http, offline, prompt):
    ids = offline.tokenizer.encode(prompt)
    ref = reference_prompt_logprobs(offline, prompt)
    # the second time, the prompt's full blocks are in the prefix cache: every log-prob still comes back
    for _ in range(2):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        assert lp["tokens"] == [offline.tokenizer.token_name(t) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(ref[1:], abs=1e-5)
        for i, top in enumerate(lp["top_logprobs"][1:], start=1):
            assert lp["tokens"][i] in top and 1 <= len(top) <= 2
        assert "".join(lp["tokens"]) == prompt
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_with_generation_streamed_and_not(http, server, offline):
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    generated = offline.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
    num_prompt = len(offline.tokenizer.encode(PROMPT))
    assert whole["text"] == PROMPT + generated.text
    assert len(whole["logprobs"]["tokens"]) == num_prompt + 4
    assert whole["logprobs"]["token_logprobs"][0] is None
    assert all(x is not None for x in whole["logprobs"]["token_logprobs"][1:])
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]


def test_max_tokens_0_without_echo_is_400(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_multiple_choice_accuracy_equals_the_in_process_one(http, offline):
    """lm-eval's log-likelihood request: context + continuation as token ids, echo, max_tokens 0, logprobs 1;
    the score of a choice is the sum of its continuation's token log-probs."""
    tok = offline.tokenizer
    served, local = [], []
    for row in TASK:
        ctx = tok.encode(row["context"])
        scores_served, scores_local = [], []
        for choice in row["choices"]:
            ids = ctx + tok.encode(choice)
            r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                    "temperature": 0})
            lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            scores_served.append(sum(lp[len(ctx):]))
            scores_local.append(sum(reference_prompt_logprobs(offline, ids)[len(ctx):]))
        assert scores_served == pytest.approx(scores_local, abs=1e-4)
        served.append(max(range(len(scores_served)), key=scores_served.__getitem__) == row["gold"])
        local.append(max(range(len(scores_local)), key=scores_local.__getitem__) == row["gold"])
    assert sum(served) / len(TASK) == sum(local) / len(TASK)


def test_tokenizer_info_and_version(http, offline):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|pad|>"
    assert info["chat_template"] == offline.tokenizer.chat_template
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model_max_length"] == offline.engine.max_model_len
    assert http.get("/version").json() == {"version": pagedrl.__version__}
