"""vLLM's chat-template flags and their neighbours, on the app in process: `--chat-template` (a file or
the template itself, replacing the model's on every route), `--chat-template-content-format`,
`--response-role`, `--trust-request-chat-template`, `--enable-log-requests` with `--max-log-len` and
`--enable-log-outputs`, and `--disable-fastapi-docs`."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.model.content_format import detected_content_format
from pagedrl.model.loader import load_model
from pagedrl.server.app import build_app
from pagedrl.server.chat_template_flags import ChatRendering, chat_template_problem, load_chat_template
from pagedrl.server.errors import ApiError
from pagedrl.server.inputs import chat_prompt_ids
from pagedrl.server.protocol import ChatMessage
from pagedrl.server.serve import build_parser, serve_main

# Says which shape each message's content reached it in: S: a string, L: a list of text parts.
PROBE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}S:{{ m['content'] }}"
         "{% else %}L:{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}|{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "c"}]


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


def rendered(tokenizer, messages, rendering: ChatRendering, add_generation_prompt: bool = False) -> str:
    ids = chat_prompt_ids(tokenizer, [ChatMessage(**m) for m in messages], add_generation_prompt, rendering=rendering)
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_value_is_a_file_else_the_template_unless_it_looks_like_a_path(tmp_path) -> None:
    """vLLM's rule: what opens is a file; what does not is the template, unless it has none of {, } and a
    newline: then it was meant as a path, and the server says so rather than serve that one line."""
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN, encoding="utf-8")
    assert load_chat_template(str(path)) == PLAIN and load_chat_template(PLAIN) == PLAIN
    with pytest.raises(ValueError, match=r"^--chat-template templates/chatml\.jinja: looks like a file path, but it "
                                         r"could not be opened \(No such file or directory\)"):
        load_chat_template("templates/chatml.jinja")
    assert chat_template_problem(str(path)) is None and chat_template_problem(None) is None
    assert chat_template_problem("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}") == \
        "--chat-template: syntax error at line 2: unexpected '}'"
    path.write_text("{{ broken", encoding="utf-8")
    assert chat_template_problem(str(path)) == f"--chat-template {path}: syntax error at line 1: unexpected end of template, " \
        "expected 'end of print statement'."


def test_serve_refuses_a_template_that_does_not_compile_before_the_model_loads(capsys) -> None:
    assert serve_main(["/no/such/model", "--chat-template", "{% if x %}\nno end"]) == 2  # the model is never read
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedrl serve: --chat-template: syntax error at line 2: ") and "\n" not in err
    assert serve_main(["/no/such/model", "--chat-template", "missing.jinja"]) == 2
    assert "--chat-template missing.jinja: looks like a file path" in capsys.readouterr().err
    assert serve_main(["/no/such/model", "--max-log-len", "-1"]) == 2
    args = build_parser().parse_args([])
    assert (args.chat_template, args.chat_template_content_format, args.response_role, args.enable_log_requests,
            args.max_log_len, args.disable_fastapi_docs) == (None, "auto", "assistant", False, None, False)
    assert (args.enable_log_outputs, args.trust_request_chat_template) == (False, False)


def test_auto_detects_a_template_that_loops_over_a_message_s_content() -> None:
    assert detected_content_format(PLAIN) == "string"
    assert detected_content_format(PROBE) == "openai"
    # through a variable set from messages, a filter and a slice, as vLLM's detection follows them
    assert detected_content_format("{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content | list %}"
                                   "{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert detected_content_format("{% for m in messages %}{% for p in other %}{% endfor %}{% endfor %}") == "string"


def test_content_reaches_the_template_joined_or_as_parts(tok) -> None:
    assert rendered(tok, TWO_PARTS, ChatRendering(PROBE, "string")) == "<user>S:a\nb|<assistant>S:c|"
    assert rendered(tok, TWO_PARTS, ChatRendering(PROBE, "openai")) == "<user>L:[a][b]|<assistant>L:[c]|"
    assert rendered(tok, TWO_PARTS, ChatRendering(PROBE)) == "<user>L:[a][b]|<assistant>L:[c]|"  # auto
    # a tool's answer stays a string, as vLLM gives it; a null assistant content is no parts
    tool_turns = [{"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}]
    tools_probe = "{# tools #}" + PROBE  # a template naming tools renders them itself: no Hermes rewrite
    assert rendered(tok, tool_turns, ChatRendering(tools_probe, "openai")) == "<assistant>L:|<tool>S:42|"
    # the server's template replaces the model's (ChatML here)
    assert rendered(tok, TWO_PARTS, ChatRendering(PLAIN)) == "user: a\nb\nassistant: c\n"
    assert "<|im_start|>" in rendered(tok, TWO_PARTS, ChatRendering())


def test_a_model_without_a_template_points_to_the_flag(tok) -> None:
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(ApiError, match="--chat-template"):
        chat_prompt_ids(bare, [ChatMessage(role="user", content="hi")], True)
    assert rendered(bare, TWO_PARTS, ChatRendering(PLAIN)) == "user: a\nb\nassistant: c\n"


@pytest.fixture(scope="module")
def http(loaded) -> Iterator[TestClient]:
    """A server for a model without a chat template, given one with --chat-template, its answers' role
    'bot', its requests and answers logged (cut to 5), and no API documents."""
    bare = copy.copy(loaded.tokenizer)
    bare.chat_template = None
    engine = LLMEngine(loaded.model, bare, EngineConfig(kv_cache_tokens=2048), eos_token_ids=loaded.eos_token_ids)
    app = build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, chat_template=PROBE, response_role="bot",
                    enable_log_requests=True, max_log_len=5, enable_log_outputs=True, fastapi_docs=False)
    with TestClient(app) as client:
        yield client


def test_the_served_template_is_used_on_every_route(http, loaded) -> None:
    want = loaded.tokenizer.encode("<user>L:[a][b]|<assistant>L:[c]|<user>L:[d]|<assistant>",
                                   add_special_tokens=False)
    messages = [*TWO_PARTS, {"role": "user", "content": "d"}]
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == want
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             *messages[1:]]
    r = http.post("/v1/responses", json={"input": items, "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(want)
    assert http.get("/tokenizer_info").json()["chat_template"] == PROBE


def test_the_start_up_log_says_which_content_format_and_why(loaded, caplog) -> None:
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=256),
                       eos_token_ids=loaded.eos_token_ids)
    with caplog.at_level(logging.INFO, logger="pagedrl.server"):
        build_app(AsyncEngine(engine), served_model_name="tiny", chat_template=PROBE)
        build_app(AsyncEngine(engine), served_model_name="tiny", chat_template_content_format="openai")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat template")]
    assert lines == ["chat template from --chat-template; message content reaches it as openai (detected from the "
                     "template; --chat-template-content-format string|openai overrides)",
                     "chat template the model's; message content reaches it as openai "
                     "(--chat-template-content-format)"]


def test_the_answer_s_role_is_the_response_role_else_the_last_message_s(http) -> None:
    """vLLM's get_chat_request_role: --response-role with a generation prompt, else the last message's role."""
    def roles(**body) -> tuple[str, str]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"]
        events = http.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        first = json.loads(next(e for e in events if e.startswith("data: {"))[len("data: "):])
        return whole, first["choices"][0]["delta"]["role"]

    assert roles() == ("bot", "bot")
    assert roles(add_generation_prompt=False) == ("user", "user")
    assert roles(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}],
                 add_generation_prompt=False, continue_final_message=True) == ("assistant", "assistant")


def test_each_request_is_logged_by_its_id_its_prompt_cut_to_max_log_len(http, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="pagedrl.server.requests"):
        http.post("/v1/chat/completions", headers={"X-Request-Id": "log-1"},
                  json={"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1})
        http.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 1, "request_id": "log-2"})
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.msg.startswith("Received")]
    assert [m.split(":")[0] for m in info] == ["Received request chatcmpl-log-1", "Received request cmpl-log-2-0",
                                               "Received request cmpl-log-2-1"]
    assert all("params: SamplingParams(" in m and "lora_request: None." in m for m in info)
    details = next(r for r in caplog.records if r.levelno == logging.DEBUG and "chatcmpl-log-1" in r.getMessage())
    _, prompt, ids = details.args
    assert prompt == "<user" and len(ids) == 5


def test_no_api_documents_with_disable_fastapi_docs(http) -> None:
    assert [http.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]


GENERATED = "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s"  # vLLM's words


def test_each_answer_is_logged_cut_to_max_log_len(http, caplog) -> None:
    """--enable-log-outputs: a whole chat answer, each streamed delta and the stream's whole text, and a
    Responses answer, as vLLM's RequestLogger.log_outputs logs them."""
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="pagedrl.server.requests"):
        whole = http.post("/v1/chat/completions", headers={"X-Request-Id": "out-1"}, json=body).json()
        http.post("/v1/chat/completions", headers={"X-Request-Id": "out-2"}, json={**body, "stream": True})
        answer = http.post("/v1/responses", json={"input": "hello there", "max_output_tokens": 4, "request_id": "r-3"})
    logged = [r.args for r in caplog.records if r.msg == GENERATED]
    text = whole["choices"][0]["message"]["content"]
    assert logged[0] == ("chatcmpl-out-1", "", text[:5], logged[0][3], "length") and len(logged[0][3]) == 4
    deltas = [a for a in logged if a[:2] == ("chatcmpl-out-2", " (streaming delta)")]
    assert "".join(a[2] for a in deltas) == text and [a[4] for a in deltas][-1] == "length"
    assert ("chatcmpl-out-2", " (streaming complete)", text[:5], None, "streaming_complete") in logged
    assert logged[-1] == ("r-3", "", answer.json()["output"][0]["content"][0]["text"][:5], logged[-1][3], "length")


def test_a_request_s_own_template_needs_trust_request_chat_template(http, loaded) -> None:
    """vLLM's rule: a request's chat_template (or chat_template_kwargs.chat_template, which wins) is a 400
    unless the server was started with --trust-request-chat-template; with it, it renders that request."""
    messages = [{"role": "user", "content": "d"}]
    for field, param in ((dict(chat_template=PLAIN), "chat_template"),
                         (dict(chat_template_kwargs={"chat_template": PLAIN}), "chat_template_kwargs.chat_template")):
        for path, body in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
            r = http.post(path, json={"messages": messages, **body, **field})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["message"].startswith("Chat template is passed with request, but "
                                                           "--trust-request-chat-template is not set.")
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=256),
                       eos_token_ids=loaded.eos_token_ids)
    app = build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, trust_request_chat_template=True)
    with TestClient(app) as trusted:
        want = loaded.tokenizer.encode("user: d\n", add_special_tokens=False)
        asked = {"messages": messages, "chat_template": "{{ 'not this' }}", "chat_template_kwargs": {"chat_template": PLAIN}}
        assert trusted.post("/tokenize", json=asked).json()["tokens"] == want
        r = trusted.post("/v1/chat/completions", json={**asked, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(want), r.text
        assert trusted.post("/tokenize", json={"messages": messages}).json()["tokens"] != want  # the model's (ChatML)
        bad = trusted.post("/v1/chat/completions", json={"messages": messages, "chat_template": "{{ broken"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
        assert "syntax error at line 1" in bad.json()["error"]["message"]
        served = trusted.get("/openapi.json").json()["components"]["schemas"]
    # /openapi.json says what each server takes: a request's template nulled where it is refused
    refused = build_app(AsyncEngine(engine), served_model_name="tiny").openapi()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "TokenizeRequest"):
        assert served[name]["properties"]["chat_template"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
        rules = [r for rule in refused[name]["allOf"] for r in rule.get("allOf", [rule])]
        assert {"type": "null"} in [r.get("properties", {}).get("chat_template") for r in rules]
        assert "--trust-request-chat-template" not in json.dumps(served[name])
