"""`--reasoning-parser mistral` (Magistral's `[THINK]...[/THINK]`) against the cases of vLLM's own test
(tests/reasoning/test_mistral_reasoning_parser.py): each whole answer splits into vLLM's reasoning and
content, the same answer streamed in pieces of every size joins to the whole split with no part of a tag
in either field, and the prompt's last turn decides whether the reasoning is over (vLLM's
`is_reasoning_end` cases, as text). Then through the chat route on the app in process, with a tokenizer
in which both tags are special tokens: the answer is read with them kept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.inputs import answer_decoding
from pagedrl.server.mistral_reasoning import (
    MistralReasoningReader,
    prompt_ends_mistral_reasoning,
    split_mistral,
)
from pagedrl.server.reasoning_parsers import ReasoningPlan, reasoning_plan

# (answer, reasoning, content) as vLLM's non-streaming extract_reasoning gives them (its streamed answers
# agree, but for the empty one's content: None there, "" here)
VLLM_CASES = [
    ("This is a reasoning section[/THINK]This is the rest", None, "This is a reasoning sectionThis is the rest"),
    ("This is a reasoning section[/THINK]", None, "This is a reasoning section"),
    ("[THINK]This is reasoning", "This is reasoning", None),
    ("This is content", None, "This is content"),
    ("This\nThat[/THINK]This is the rest\nThat", None, "This\nThatThis is the rest\nThat"),
    ("[/THINK]This is the rest", None, "This is the rest"),
    ("[THINK]This is a reasoning section[/THINK]This is the rest", "This is a reasoning section", "This is the rest"),
    ("[THINK]This is a reasoning section[/THINK]", "This is a reasoning section", None),
    ("[THINK]This\nThat[/THINK]This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("[THINK]This is a reasoning section", "This is a reasoning section", None),
    ("", None, ""),
    ("Before\n[THINK]This is a reasoning section[/THINK]\nThis is the rest", "This is a reasoning section",
     "Before\n\nThis is the rest"),
    ("[THINK]Let me think about this[/THINK]The answer is 42", "Let me think about this", "The answer is 42"),
    ("Just the answer, no thinking", None, "Just the answer, no thinking"),
    # tags after the first pair are dropped, as vLLM streams them (its whole answer keeps them in the content)
    ("[THINK]a[/THINK]b[/THINK]c", "a", "bc"),
    ("[THINK]a[THINK]b[/THINK]c[THINK]d", "ab", "cd"),
    ("[THINK][/THINK]", "", None),
]


def streamed(text: str, size: int) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    reader = MistralReasoningReader()
    deltas = [reader.feed(text[i:i + size]) for i in range(0, len(text), size)] + [reader.finish()]
    reasoning, content = "".join(r for r, _ in deltas), "".join(c for _, c in deltas)
    return reasoning or None, content or None, deltas


@pytest.mark.parametrize("text,reasoning,content", VLLM_CASES)
def test_whole_and_streamed_answers_split_as_vllms_parser(text, reasoning, content) -> None:
    assert split_mistral(text) == (reasoning, content)
    assert ReasoningPlan("mistral").split(text) == (reasoning, content)
    for size in range(1, max(len(text), 1) + 1):
        r, c, deltas = streamed(text, size)
        assert (r, c) == (reasoning or None, content or None), size
        assert not any(tag in piece for d in deltas for piece in d for tag in ("[THINK]", "[/THINK]"))


def test_reasoning_streams_before_the_answer_ends() -> None:
    reader = MistralReasoningReader()
    assert reader.feed("[TH") == ("", "")  # may be a tag: held
    assert reader.feed("INK]Let me") == ("Let me", "")
    assert reader.feed(" see.[/") == (" see.", "")
    assert reader.feed("THINK]4") == ("", "4")
    assert reader.finish() == ("", "")
    assert MistralReasoningReader().feed("[TOOL_CALLS]f") == ("", "[TOOL_CALLS]f")  # not a think tag: sent


# vLLM's is_reasoning_end cases, the prompt as text: only its last turn (after [/INST] or [/TOOL_RESULTS]) counts
PROMPTS = [
    ("[SYSTEM_PROMPT]For example:[THINK]example reasoning[/THINK]done[/SYSTEM_PROMPT][INST]Capital?[/INST]", False),
    ("[INST]call a tool[/INST][TOOL_RESULTS][THINK]tool-side reasoning[/THINK]tool output[/TOOL_RESULTS]", False),
    ("[/INST][THINK]reasoning for the first turn[/THINK]first answer</s>[INST]second question[/INST]", False),
    ("[/INST][THINK]current turn reasoning[/THINK]partial answer so far", True),
    ("[/INST][THINK]still reasoning", False),
    ("[SYSTEM_PROMPT]sys[THINK]example[/THINK]done[/SYSTEM_PROMPT][INST]q[/INST][THINK]model reasoning now", False),
    ("[INST]q[/INST]", False),
]


@pytest.mark.parametrize("prompt,ended", PROMPTS)
def test_only_the_prompts_last_turn_can_end_the_reasoning(prompt, ended) -> None:
    assert prompt_ends_mistral_reasoning(prompt) is ended
    plan = reasoning_plan("mistral", None, False, prompt)
    assert plan.prompt_ended is ended and plan.keeps_special_tokens is not ended
    if ended:  # the answer continues the content, as written
        assert plan.split("more[/THINK]x") == (None, "more[/THINK]x")
        assert plan.reader().feed("[THINK]a") == ("", "[THINK]a")


def test_mistral_answers_are_decoded_with_their_special_tokens() -> None:
    """The tags are special tokens: a thinking answer keeps them in its text (the mechanism gpt-oss's
    answers use), one a grammar writes (all content) and one of a prompt that ended the reasoning do not
    need them; the request's own params are left as they are."""
    params = SamplingParams(max_tokens=8)
    plan, decoding = answer_decoding(None, reasoning_plan("mistral", None, False, "[INST]q[/INST]"), params)
    assert decoding.skip_special_tokens is False and params.skip_special_tokens is True
    for thinking in (reasoning_plan("mistral", None, True, "[INST]q[/INST]"), ReasoningPlan("mistral", prompt_ended=True),
                     ReasoningPlan("deepseek_r1")):
        assert answer_decoding(None, thinking, params) == (None, params)
    constrained = ReasoningPlan("mistral", thinking=False)
    assert constrained.split("[THINK]a[/THINK]b") == (None, "[THINK]a[/THINK]b")


# ---------------------------------------------------------------------------- the chat route
SPECIALS = ["</s>", "[INST]", "[/INST]", "[THINK]", "[/THINK]"]
WORDS = ["[THINK]", "[/THINK]", "a", "b", "</s>"]


def build_magistral_tokenizer(folder: Path) -> None:
    """A byte-level BPE whose special tokens are Magistral's (the tags among them), with its template's turns."""
    from tiny_train import build_tokenizer

    build_tokenizer(folder, SPECIALS, "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}", "</s>", None)


@pytest.fixture(scope="module")
def http(tmp_path_factory) -> Iterator[TestClient]:
    from tiny_train import build_model_dir

    from pagedrl.engine.async_engine import AsyncEngine
    from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
    from pagedrl.model.loader import load_model
    from pagedrl.server.app import build_app

    folder = build_model_dir(tmp_path_factory.mktemp("magistral") / "model", tokenizer=build_magistral_tokenizer,
                             eos_token_id=0)
    loaded = load_model(folder, device="cpu")
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048),
                       eos_token_ids=loaded.eos_token_ids)
    app = build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, reasoning_parser="mistral")
    with TestClient(app) as client:
        client.tokenizer = loaded.tokenizer
        yield client


def joined(body: str) -> tuple[str | None, str | None]:
    reasoning, content = "", ""
    for line in body.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning") or ""
                content += choice["delta"].get("content") or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_chat_route_reads_the_tags_the_model_writes(http, seed) -> None:
    """Sampling among the tags and two letters makes answers full of tags; the message is the split of its
    own tokens decoded with the special tokens kept, whole and streamed alike."""
    tok = http.tokenizer
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in WORDS]
    assert len(set(allowed)) == len(WORDS)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": seed, "max_tokens": 40,
            "min_tokens": 12, "allowed_token_ids": allowed, "return_token_ids": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = [i for i in choice["token_ids"] if i != allowed[-1]]
    text = tok.decode(ids, skip_special_tokens=False)
    assert "[THINK]" in text or "[/THINK]" in text  # the reading is not vacuous
    reasoning, content = split_mistral(text)
    assert (choice["message"].get("reasoning"), choice["message"]["content"]) == (reasoning, content or None)
    assert choice["message"].get("reasoning_content") == choice["message"].get("reasoning")
    streamed_body = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert joined(streamed_body) == (reasoning or None, content or None)


def test_a_grammar_starts_after_the_reasoning(http) -> None:
    """vLLM's structured outputs wait for the reasoning to end: the answer is free until the model samples
    [/THINK], then held to the grammar (here `bbb`, then the end). Sampling among the tags and two letters,
    every sample that closed its reasoning writes exactly `bbb` after it, and what it wrote before is free."""
    tok = http.tokenizer
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in WORDS]
    end, eos = allowed[1], allowed[-1]
    closed, free = 0, 0
    for seed in range(3):
        body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": seed, "max_tokens": 40,
                "n": 8, "allowed_token_ids": allowed, "return_token_ids": True, "structured_outputs": {"regex": "bbb"}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            ids = choice["token_ids"]
            if end not in ids[:-1] or ids[-1] != eos and len(ids) == 40:
                continue  # never closed its reasoning (or cut off by max_tokens while thinking)
            at = ids.index(end)
            closed += 1
            free += "a" in tok.decode(ids[:at])
            assert tok.decode([i for i in ids[at + 1:] if i != eos]) == "bbb" and choice["finish_reason"] == "stop"
            reasoning, content = split_mistral(tok.decode([i for i in ids if i != eos], skip_special_tokens=False))
            assert (choice["message"].get("reasoning"), choice["message"]["content"]) == (reasoning, content or None)
            assert content.endswith("bbb")
    assert closed and free  # the check is not vacuous: answers closed their reasoning, written freely before


class OneTokenTags:
    """A tokenizer in which both think tags are single tokens, as in DeepSeek's, Qwen3's and Mistral's."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"</think>": [7], "[/THINK]": [9]}.get(text, [1, 2])


def test_which_requests_start_their_grammar_after_the_reasoning() -> None:
    from pagedrl.engine.structured_outputs import StructuredOutputsParams
    from pagedrl.server.reasoning_parsers import grammar_after_reasoning, reasoning_end_token

    tok = OneTokenTags()
    assert [reasoning_end_token(p, tok) for p in ("deepseek_r1", "deepseek_v3", "qwen3", "mistral", "openai_gptoss")] \
        == [7, 7, 7, 9, None]
    assert reasoning_end_token("deepseek_r1", type("T", (), {"encode": lambda self, t, **k: [1, 2]})()) is None
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a"))
    gated = grammar_after_reasoning(ReasoningPlan("qwen3"), params, 7)
    assert gated.structured_outputs.reasoning_end_token_ids == (7,) and params.structured_outputs.reasoning_end_token_ids == ()
    for plan in (ReasoningPlan("qwen3", thinking=False), ReasoningPlan("qwen3", prompt_ended=True), None):
        assert grammar_after_reasoning(plan, params, 7) is params  # held from the first token
    assert grammar_after_reasoning(ReasoningPlan("qwen3"), params, None) is params
    unconstrained = SamplingParams(max_tokens=8)
    assert grammar_after_reasoning(ReasoningPlan("qwen3"), unconstrained, 7) is unconstrained
    with pytest.raises(ValueError, match="structured_outputs.reasoning_end_token_ids"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=("x",))
    with pytest.raises(ValueError, match="reasoning_end_token_ids is not supported"):  # the server's, not the request's
        StructuredOutputsParams.from_dict({"regex": "a", "reasoning_end_token_ids": [1]})
