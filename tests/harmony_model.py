"""A tiny gpt-oss model folder that speaks in harmony's markup: a byte-level BPE tokenizer holding gpt-oss's
special tokens (`<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`, `<|call|>`, ...) and a few
header words as ordinary added tokens, gpt-oss's chat template cut down to what it does with assistant
turns, tool calls and tool answers, and `<|return|>` and `<|call|>` as the end of an answer, as gpt-oss's
generation_config.json makes them."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_train import MOE, build_model_dir, build_tokenizer

HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|return|>", "<|call|>"]
HEADER_WORDS = ["analysis", "final", "commentary", " to=functions.get_weather", "json"]  # ordinary text, one token each
# gpt-oss's template (chat_template.jinja of openai/gpt-oss-20b) for the turns a chat sends back: an assistant
# turn's `thinking` rendered only where a tool call follows it and no later final answer does, its call as a
# commentary message to functions.NAME ending in <|call|>, a tool's answer as a message from functions.NAME.
# Its system and developer messages are left out; the tools are listed as JSON.
GPT_OSS_TEMPLATE = """
{%- set last_tool_call = namespace(name=none) -%}
{%- if tools -%}<|start|>developer<|message|># Tools

{{ tools|tojson }}<|end|>{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- if "tool_calls" in message -%}
{%- set future_final_message = namespace(found=false) -%}
{%- for future_message in messages[loop.index:] -%}
{%- if future_message.role == 'assistant' and "tool_calls" not in future_message -%}
{%- set future_final_message.found = true -%}
{%- endif -%}
{%- endfor -%}
{%- set tool_call = message.tool_calls[0] -%}
{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{%- if message.content and message.thinking -%}
{{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") -}}
{%- elif message.content and not future_final_message.found -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" -}}
{%- elif message.thinking and not future_final_message.found -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
{%- endif -%}
{{- "<|start|>assistant to=functions." + tool_call.name + "<|channel|>commentary json<|message|>" -}}
{{- tool_call.arguments|tojson + "<|call|>" -}}
{%- set last_tool_call.name = tool_call.name -%}
{%- elif loop.last and not add_generation_prompt -%}
{%- if "thinking" in message -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
{%- endif -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" -}}
{%- else -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
{%- set last_tool_call.name = none -%}
{%- endif -%}
{%- elif message.role == 'tool' -%}
{{- "<|start|>functions." + last_tool_call.name + " to=assistant<|channel|>commentary<|message|>" -}}
{{- message.content|tojson + "<|end|>" -}}
{%- else -%}
{{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""


def build_harmony_tokenizer(folder: Path) -> None:
    build_tokenizer(folder, HARMONY_SPECIALS, GPT_OSS_TEMPLATE, "<|return|>", "<|endoftext|>", tuple(HEADER_WORDS))


def build_harmony_model_dir(folder: Path) -> Path:
    """The tiny gpt-oss model with the harmony tokenizer. As in the published gpt-oss folders, config.json's
    eos_token_id is <|return|> alone and generation_config.json's adds <|endoftext|> and <|call|>."""
    ids = {token: HARMONY_SPECIALS.index(token) for token in HARMONY_SPECIALS}  # the trainer's first ids
    build_model_dir(folder, tokenizer=build_harmony_tokenizer, max_position_embeddings=1024,
                    eos_token_id=ids["<|return|>"], **MOE["gpt-oss"])
    ends = [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return folder
