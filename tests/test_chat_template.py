"""Chat templates render byte-identically to transformers' `apply_chat_template`."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import transformers
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from pagedrl.model.chat_template import ChatTemplateError, render_chat_template
from pagedrl.model.tokenizer import Tokenizer

# The chat_template of Qwen/Qwen2.5-*-Instruct's tokenizer_config.json, verbatim.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SYSTEM = {"role": "system", "content": "You are terse. Ünïcödé & <html> are fine."}
CONVERSATIONS = {
    "one-user": [{"role": "user", "content": "What is the capital of France?"}],
    "system-user": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "multi-turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?\n  With  spaces. "},
        {"role": "assistant", "content": "12 🎉"},
        {"role": "user", "content": "日本語で?"},
    ],
    "system-multi-turn": [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}],
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a <city> & région",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "<b>wind</b>"},
]


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, object]:
    """A tokenizer carrying Qwen2.5's template, and transformers' reading of the folder it saves."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Backend(models.WordLevel({t: i for i, t in enumerate([*specials, "hi"])}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ours = Tokenizer(backend, chat_template=QWEN25_TEMPLATE,
                     special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    folder = ours.save(tmp_path_factory.mktemp("qwen25"))
    return ours, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_qwen25_template_matches_transformers(qwen_pair, name: str, add_generation_prompt: bool) -> None:
    ours, ref = qwen_pair
    messages = CONVERSATIONS[name]
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_qwen25_tools_and_tojson_match_transformers(qwen_pair, add_generation_prompt: bool) -> None:
    ours, ref = qwen_pair
    got = ours.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=add_generation_prompt)
    want = ref.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=add_generation_prompt,
                                   tokenize=False)
    assert got == want
    assert "<city> & région" in got  # tojson neither HTML-escapes nor ASCII-escapes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_smollm2_template_matches_transformers(default_model_dir: Path, default_tokenizer, name: str,
                                               add_generation_prompt: bool) -> None:
    ref = _smollm2_reference(default_model_dir)
    messages = CONVERSATIONS[name]
    text = default_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = default_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False)
    assert ("You are a helpful AI assistant named SmolLM" in text) == (messages[0]["role"] != "system")


_REFERENCES: dict[Path, object] = {}


def _smollm2_reference(folder: Path):
    if folder not in _REFERENCES:
        _REFERENCES[folder] = transformers.AutoTokenizer.from_pretrained(folder)
    return _REFERENCES[folder]


@pytest.mark.slow
def test_smollm2_template_comes_from_the_gguf(default_model_dir: Path, default_tokenizer) -> None:
    from pagedrl.model.default import default_gguf_path

    gguf = default_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert default_tokenizer.chat_template == ref.chat_template
    messages = CONVERSATIONS["multi-turn"]
    assert default_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def test_extra_variables_override_special_tokens_like_transformers(qwen_pair) -> None:
    ours, ref = qwen_pair
    template = "{{ eos_token }}|{{ enable_thinking }}|{{ missing is defined }}|{{ messages | length }}"
    for kwargs in ({}, {"enable_thinking": False}, {"eos_token": "X"}):
        got = ours.apply_chat_template(CONVERSATIONS["one-user"], chat_template=template, **kwargs)
        assert got == ref.apply_chat_template(CONVERSATIONS["one-user"], chat_template=template, tokenize=False,
                                              **kwargs)


def test_none_fields_and_reasoning_aliases_like_transformers(qwen_pair) -> None:
    ours, ref = qwen_pair
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:{{ m.reasoning_content }}:"
                "{{ m.thinking }};{% endfor %}")
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "x", "reasoning": "because"}]
    got = ours.apply_chat_template(messages, chat_template=template)
    assert got == ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert got == "user:False::;assistant:True:because:because;"


def test_trim_and_lstrip_blocks_like_transformers(qwen_pair) -> None:
    ours, ref = qwen_pair
    template = "  {% for m in messages %}\n  {{ m.content }}\n  {% if loop.last %}\nend\n  {% endif %}\n{% endfor %}"
    messages = CONVERSATIONS["system-user"]
    assert ours.apply_chat_template(messages, chat_template=template) == ref.apply_chat_template(
        messages, chat_template=template, tokenize=False)


def test_raise_exception_is_a_clear_error() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


def test_strftime_now_and_namespace_are_available() -> None:
    template = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}" \
               "{{ ns.n }} {{ strftime_now('%Y') }}"
    before = datetime.datetime.now().year
    got = render_chat_template(template, CONVERSATIONS["multi-turn"])
    assert got.split()[0] == "5" and before <= int(got.split()[1]) <= before + 1


def test_sandbox_blocks_internals() -> None:
    for template in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}"):
        with pytest.raises(ChatTemplateError):
            render_chat_template(template, CONVERSATIONS["one-user"])


def test_bad_input_is_a_clear_error(qwen_pair) -> None:
    ours, _ = qwen_pair
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]"):
        ours.apply_chat_template(["hello"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for %}", CONVERSATIONS["one-user"])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(ours.backend).apply_chat_template(CONVERSATIONS["one-user"])
    # a template passed by text works without one
    assert Tokenizer(ours.backend).apply_chat_template(CONVERSATIONS["one-user"], chat_template="n={{ messages|length }}"
                                                       ) == "n=1"
    with pytest.raises(ChatTemplateError, match="none is named 'default'"):
        Tokenizer(ours.backend, chat_template={"a": "x", "b": "y"}).apply_chat_template(CONVERSATIONS["one-user"])
