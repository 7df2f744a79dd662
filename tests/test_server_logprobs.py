"""Log-probs of tokens that are only part of a UTF-8 character, from a real `pagedrl serve` process on the
default model: an emoji is split over byte-level tokens, each of which decodes to U+FFFD alone. Each
must keep its own name (`bytes:\\xNN`, so a position's entries never collide), its own bytes (which
rebuild the text) and its exact log-prob, and text offsets must index the returned text."""

from __future__ import annotations

import httpx
import pytest
from server_process import running_server

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams

PROMPT = "Pizza emoji: 🍕🍕🍕"
K = 5


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with running_server(default_model_dir, tmp_path_factory.mktemp("serve-logprobs"), "--kv-cache-tokens",
                        "2048", "--served-model-name", "smol") as s:
        yield s


@pytest.fixture(scope="module")
def offline(default_model_dir):
    return LLM(str(default_model_dir), device="cpu", kv_cache_tokens=2048)


def test_partial_character_tokens_have_exact_distinct_logprobs(client, offline):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=K)
    choice = r.choices[0]
    lp = choice.logprobs
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=K), use_tqdm=False)[0]
    out = ref.outputs[0]
    tok = offline.tokenizer
    assert choice.text == out.text
    partial = [t for t in out.token_ids if tok.token_name(t).startswith("bytes:")]
    assert partial, f"the model's answer {out.text!r} has no token inside a character; the test needs one"
    rebuilt = b""
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        name = tok.token_name(token_id)
        assert lp.tokens[i] == name
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) == len(entry) in (K, K + 1)  # no two entries share a name
        assert lp.top_logprobs[i][name] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        raw = tok.token_bytes(token_id)
        # the name holds the bytes: as text, or as \xNN escapes
        assert (name.encode() if not name.startswith("bytes:")
                else bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])) == raw
        assert lp.text_offset[i] == len(rebuilt.decode("utf-8", errors="ignore"))
        assert 0 <= lp.text_offset[i] <= len(choice.text)
        rebuilt += raw
    assert rebuilt.decode() == choice.text


def test_chat_bytes_are_each_tokens_own_and_rebuild_the_text(client, offline):
    messages = [{"role": "user", "content": PROMPT}]
    for stream in (False, True):
        kwargs = dict(model="smol", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=K)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            content = [item for c in chunks if c.choices and c.choices[0].logprobs
                       for item in c.choices[0].logprobs.content]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.chat.completions.create(**kwargs)
            content, text = r.choices[0].logprobs.content, r.choices[0].message.content
        assert b"".join(bytes(item.bytes) for item in content).decode() == text
        for item in content:
            assert len({t.token for t in item.top_logprobs}) == len(item.top_logprobs) == K
            for t in [item, *item.top_logprobs]:
                assert t.token.encode() == bytes(t.bytes) or t.token.startswith("bytes:")


def test_streamed_offsets_equal_the_whole_response(server, client):
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": K}
    whole = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    parts = list(client.completions.create(stream=True, **body))
    offsets = [o for p in parts if p.choices and p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    tokens = [t for p in parts if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.tokens]
    assert offsets == whole["text_offset"] and tokens == whole["tokens"]
