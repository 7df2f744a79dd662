"""Each `--tool-call-parser` through the chat route, on the app in process: a regex constraint makes the
random model write a call in the parser's format after some text, and the answer must come back as
that call with the text as its content (its id as vLLM makes it), streamed and not alike."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.model.loader import load_model
from pagedrl.server.app import build_app

CITY = '"(Paris|Rome)"'
# What each parser reads, as a regex the model is held to (after "Checking. ")
FORMATS = {
    "hermes": r'<tool_call>\{"name": "get_weather", "arguments": \{"city": ' + CITY + r"\}\}</tool_call>",
    "llama3_json": r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": ' + CITY + r"\}\}",
    "pythonic": r"\[get_weather\(city=" + CITY + r"\)\]",
    "llama4_pythonic": r"<\|python_start\|>\[get_weather\(city=" + CITY + r"\)\]<\|python_end\|>",
    "mistral": r"\[TOOL_CALLS\]get_weather\[ARGS\]\{\"city\": " + CITY + r"\}",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    r'\{"city": ' + CITY + r"\}" + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": r"<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.get_weather:0"
               r'<\|tool_call_argument_begin\|>\{"city": ' + CITY + r"\}<\|tool_call_end\|><\|tool_calls_section_end\|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   r'\{"city": ' + CITY + r"\}" + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}
ID = {"mistral": "[A-Za-z0-9]{9}", "kimi_k2": r"functions\.get_weather:0"}  # vLLM's ids; else OpenAI's
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a template that reads `tools` (so they are not written into the prompt in Hermes' words): a short prompt
TEMPLATE = "{% if tools %}[tools]{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    from tiny_train import build_model_dir

    # the DeepSeek markers are many byte-level tokens each: a context longer than the usual 256
    loaded = load_model(build_model_dir(tmp_path_factory.mktemp("parsers-model") / "model",
                                        max_position_embeddings=1024), device="cpu")
    return LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=4096),
                     eos_token_ids=loaded.eos_token_ids)


def client(engine: LLMEngine, parser: str) -> Iterator[TestClient]:
    app = build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, chat_template=TEMPLATE,
                    tool_call_parser=parser, enable_auto_tool_choice=True)
    with TestClient(app) as http:
        yield http


def reassembled(body: str) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """Content, (id, name, arguments) of each call, and the finish reason of a streamed choice 0."""
    content, calls, finish = "", {}, None
    for line in body.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += d.get("id") or ""
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_each_parser_reads_its_format_streamed_and_not(engine, parser) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 400,
            "temperature": 1.0, "seed": 5, "structured_outputs": {"regex": "Checking\\. " + FORMATS[parser]}}
    for http in client(engine, parser):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
        assert re.fullmatch(ID.get(parser, "call_[0-9a-f]{24}"), call["id"])
        content, calls, finish = reassembled(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
        assert (content, [c[1:] for c in calls], finish) == (
            "Checking.", [("get_weather", call["function"]["arguments"])], "tool_calls")
        assert re.fullmatch(ID.get(parser, "call_[0-9a-f]{24}"), calls[0][0])
