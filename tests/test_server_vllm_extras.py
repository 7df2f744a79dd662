"""vLLM's request fields beyond OpenAI's, through the official `openai` client's `extra_body` on a real
`pagedrl serve` process started with vLLM's `--return-tokens-as-token-ids`: `return_token_ids`,
`return_tokens_as_token_ids`, `cache_salt` and `stream_options.continuous_usage_stats`. The ids are held
to the engine's: the tokenizer's encoding of the prompt and `LLM.generate`'s (or `LLM.chat`'s) output."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from server_process import running_server

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model

PROMPT = "the cat sat on the mat"
CHAT = [{"role": "user", "content": "what is two plus three"}]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ASK = dict(model="tiny", max_tokens=4, temperature=0)
IDS = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-extras"), "--kv-cache-tokens", "2048",
                        "--served-model-name", "tiny", "--return-tokens-as-token-ids") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=2048)


def extra(obj: Any, name: str) -> Any:
    """A field the `openai` types do not declare (vLLM's), or None where the answer leaves it out."""
    return (obj.model_extra or {}).get(name)


def test_completions_carry_the_prompts_and_the_completions_token_ids(client, offline):
    ref = offline.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert ref.prompt_token_ids == offline.tokenizer.encode(PROMPT)
    r = client.completions.create(prompt=PROMPT, extra_body=IDS, **ASK)
    assert extra(r.choices[0], "prompt_token_ids") == ref.prompt_token_ids
    assert extra(r.choices[0], "token_ids") == ref.outputs[0].token_ids
    echoed = client.completions.create(prompt=PROMPT, echo=True, extra_body=IDS, **ASK).choices[0]
    assert echoed.text == PROMPT + ref.outputs[0].text and extra(echoed, "token_ids") == ref.outputs[0].token_ids
    # streamed: the prompt's on the first chunk only, then each chunk's new ids
    chunks = [c.choices[0] for c in client.completions.create(prompt=PROMPT, stream=True, extra_body=IDS, **ASK)]
    assert [extra(c, "prompt_token_ids") for c in chunks] == [ref.prompt_token_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in extra(c, "token_ids")] == ref.outputs[0].token_ids
    plain = client.completions.create(prompt=PROMPT, **ASK).choices[0]
    assert extra(plain, "token_ids") is None and extra(plain, "prompt_token_ids") is None


def test_chat_answers_carry_the_prompts_ids_at_the_top_and_each_choices_own(client, offline):
    ref = offline.chat(CHAT, GREEDY, use_tqdm=False)[0]
    r = client.chat.completions.create(messages=CHAT, extra_body=IDS, **ASK)
    assert extra(r, "prompt_token_ids") == ref.prompt_token_ids
    assert extra(r.choices[0], "token_ids") == ref.outputs[0].token_ids
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, extra_body=IDS, **ASK))
    assert extra(chunks[0], "prompt_token_ids") == ref.prompt_token_ids and chunks[0].choices[0].delta.role
    assert all(extra(c, "prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in extra(c.choices[0], "token_ids")] == ref.outputs[0].token_ids


def test_logprobs_name_tokens_by_id_by_the_servers_flag_unless_the_request_says(client, offline):
    ref = offline.generate(PROMPT, GREEDY.clone(logprobs=2), use_tqdm=False)[0].outputs[0]
    names = [f"token_id:{t}" for t in ref.token_ids]
    lp = client.completions.create(prompt=PROMPT, logprobs=2, **ASK).choices[0].logprobs
    assert lp.tokens == names
    assert all(set(top) == {f"token_id:{t}" for t in e} for top, e in zip(lp.top_logprobs, ref.logprobs, strict=True))
    lp = client.completions.create(prompt=PROMPT, logprobs=2, extra_body={"return_tokens_as_token_ids": False},
                                   **ASK).choices[0].logprobs
    assert lp.tokens == [offline.tokenizer.token_name(t) for t in ref.token_ids]
    chat_ref = offline.chat(CHAT, GREEDY.clone(logprobs=2), use_tqdm=False)[0].outputs[0]
    for stream in (False, True):
        kwargs = dict(messages=CHAT, logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True},
                      **ASK)
        if stream:
            content = [i for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
                       and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
        else:
            content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert [i.token for i in content] == [f"token_id:{t}" for t in chat_ref.token_ids]
        assert all(t.token.startswith("token_id:") for i in content for t in i.top_logprobs)


def test_a_cache_salt_keeps_prefix_hits_to_requests_of_the_same_salt(server, client):
    long = "salted " + " and ".join([PROMPT] * 8)  # several blocks, a start no other test's prompt has

    def hits_after(route: str, salt: str) -> tuple[float, str]:
        before = server.metrics()["pagedrl:prefix_cache_hits_total"]
        if route == "chat":
            r = client.chat.completions.create(messages=[{"role": "user", "content": long}],
                                               extra_body={"cache_salt": salt}, **ASK)
            text = r.choices[0].message.content
        else:
            text = client.completions.create(prompt=long, extra_body={"cache_salt": salt}, **ASK).choices[0].text
        return server.metrics()["pagedrl:prefix_cache_hits_total"] - before, text

    for route in ("completions", "chat"):
        hits, text = hits_after(route, "alice")
        assert hits == 0
        assert hits_after(route, "bob") == (0, text)  # another salt: nothing shared, the same answer
        hits, again = hits_after(route, "alice")
        assert hits > 0 and again == text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=PROMPT, extra_body={"cache_salt": ""}, **ASK)
    assert e.value.body["param"] == "cache_salt"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for route in ("completions", "chat"):
        create = client.completions.create if route == "completions" else client.chat.completions.create
        body = {"prompt": PROMPT, "n": 2} if route == "completions" else {"messages": CHAT}
        chunks = list(create(stream=True, stream_options=options, extra_body=IDS, **body, **ASK))
        *deltas, last = chunks
        made: dict[int, int] = {}
        for c in deltas:
            (choice,) = c.choices
            made[choice.index] = made.get(choice.index, 0) + len(extra(choice, "token_ids") or [])
            assert c.usage.completion_tokens == made[choice.index]
            assert c.usage.total_tokens == c.usage.prompt_tokens + made[choice.index] and c.usage.prompt_tokens > 0
        assert not last.choices and last.usage.completion_tokens == sum(made.values()) == 4 * len(made)
        # without include_usage there is no usage to repeat, as in vLLM
        chunks = list(create(stream=True, stream_options={"continuous_usage_stats": True}, **body, **ASK))
        assert all(c.usage is None for c in chunks)
