"""vLLM's `use_beam_search` through the official `openai` client's `extra_body` on a real `pagedrl serve`
process: `n` beams on /v1/completions and /v1/chat/completions, the same as `LLM.beam_search` on the same
model (the completion's tokens and text, EOS left out), streamed or not; bad values a 400 naming the field."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from server_process import running_server
from test_beam_search import fail_the_nth_finished_request

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.beam_search import BeamSearchParams
from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.model.loader import load_model
from pagedrl.server.app import build_app

PROMPT = "the cat sat on the mat"
CHAT = [{"role": "user", "content": "what is two plus three"}]
BEAM = {"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True}
ASK = dict(model="tiny", max_tokens=4, temperature=0, n=2)


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-beam"), "--kv-cache-tokens", "2048",
                        "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=2048)


def expected(offline: LLM, prompt_ids: list[int]) -> list[tuple[list[int], str]]:
    """`LLM.beam_search`'s beams as the server answers them: the completion's ids, EOS left out, and text."""
    (out,) = offline.beam_search([prompt_ids], BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.5))
    eos = set(offline.llm_engine.eos_token_ids)
    beams = []
    for s in out.sequences:
        ids = s.tokens[len(prompt_ids):]
        ids = ids[:-1] if ids and ids[-1] in eos else ids
        beams.append((ids, offline.tokenizer.decode(ids, skip_special_tokens=False)))
    return beams


def test_completions_answer_the_n_best_beams(client, offline):
    want = expected(offline, offline.tokenizer.encode(PROMPT))
    r = client.completions.create(prompt=PROMPT, extra_body=BEAM, **ASK)
    assert [(c.model_extra["token_ids"], c.text) for c in r.choices] == want
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == sum(len(i) for i, _ in want)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, extra_body=BEAM, **ASK))
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks) == [(i, t) for i, (_, t) in enumerate(want)]


def test_chat_answers_the_n_best_beams(client, offline):
    text = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    want = expected(offline, offline.tokenizer.encode(text, add_special_tokens=False))
    r = client.chat.completions.create(messages=CHAT, response_format={"type": "text"}, extra_body=BEAM, **ASK)
    assert [(c.model_extra["token_ids"], c.message.content) for c in r.choices] == want
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, extra_body=BEAM, **ASK))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[0], texts[1]] == [t for _, t in want]


@pytest.mark.parametrize("body,param", [({"n": 0}, "n"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
                                        ({"n": 11}, "n"), ({"length_penalty": "1"}, "length_penalty")])
def test_bad_values_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=PROMPT, extra_body={**BEAM, **body}, **{k: v for k, v in ASK.items()
                                                                                 if k not in body})
    assert e.value.body["param"] == param


def test_a_beam_the_engine_fails_stops_the_search_with_a_500(tiny_train_model):
    """vLLM's server stops the search with the engine's error (500); the server goes on serving."""
    loaded = load_model(tiny_train_model, device="cpu")
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048),
                       eos_token_ids=loaded.eos_token_ids)
    fail_the_nth_finished_request(engine, 3)
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True}
    with TestClient(build_app(AsyncEngine(engine), served_model_name="tiny", ui=False)) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={**body, "stream": stream})
            error = r.json()["error"]
            assert r.status_code == 500 and error["code"] == "generation_error" and "logits are NaN" in error["message"]
            del engine.step
            assert http.post("/v1/completions", json=body).status_code == 200
            fail_the_nth_finished_request(engine, 3)
