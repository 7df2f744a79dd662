"""From an OpenAI request body to what the engine takes: prompts (text or token ids) and SamplingParams.

Fields the engine does not implement but that would change the answer (`suffix`, `best_of`, the
`UNSUPPORTED_EXTRAS`) are refused with a 400 naming them, rather than silently ignored. Tools:
`server/tools.py`. Unset sampling fields take the model's generation config's recommendation (vLLM's
`--generation-config auto`), else SamplingParams' defaults, which are OpenAI's (temperature 1, top_p 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedrl.engine.generation_defaults import capped
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.chat_template import select_chat_template
from pagedrl.model.content_format import ContentFormat
from pagedrl.server.chat_template_flags import MODEL_TEMPLATE, NO_TEMPLATE, ChatRendering
from pagedrl.server.errors import bad_request, from_value_error
from pagedrl.server.protocol import (
    COMPLETION_MAX_TOKENS,
    CONTINUE_NEEDS_NO_GENERATION_PROMPT,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from pagedrl.server.structured import structured_outputs
from pagedrl.server.tool_parsers import TOOL_PARSERS
from pagedrl.server.tools import (
    ToolPlan,
    arguments_object,
    template_handles_tools,
    tool_constraint,
    with_hermes_tools,
)

# OpenAI's limit on `n`; a server flag, since every sample is a sequence the engine runs.
DEFAULT_MAX_N = 128
# vLLM's and OpenAI's fields that would change the answer and that this server does not implement:
# refused by name (as suffix and best_of are) rather than silently ignored.
UNSUPPORTED_EXTRAS = ("functions", "function_call", "prompt_embeds", "repetition_detection", "watermarking")
OPTIONAL_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    renames: dict[str, str] | None = None, max_n: int = DEFAULT_MAX_N,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """SamplingParams for a request; a bad value is a 400 naming the request field. `defaults` (the
    model's generation config, as vLLM takes it) stand in for the sampling settings the request leaves
    unset. `logprobs` None (the request's log-probs switch off) leaves `logprob_token_ids` unused, as in
    vLLM's answer; on, the ids take the place of the top `logprobs`."""
    defaults = defaults or {}
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {req.n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM
        raise bad_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    for name in UNSUPPORTED_EXTRAS:
        if getattr(req, name, None) not in (None, False):
            raise bad_request(f"{name} is not supported", param=name)
    if req.thinking_token_budget not in (None, -1):  # -1: unlimited, vLLM's "unset"
        raise bad_request("thinking_token_budget is not supported", param="thinking_token_budget")
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, prompt_logprobs=req.prompt_logprobs,
        structured_outputs=structured_outputs(req)[0], logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
        truncate_prompt_tokens=req.truncate_prompt_tokens)
    if logprobs is not None and req.logprob_token_ids:
        kwargs["logprob_token_ids"] = req.logprob_token_ids
    else:
        kwargs["logprobs"] = logprobs
    for name in (*OPTIONAL_FLOATS, "top_k"):
        value = getattr(req, name)
        value = defaults.get(name) if value is None else value
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, renames) from None


def completion_inputs(req: CompletionRequest, max_n: int = DEFAULT_MAX_N, defaults: Mapping[str, Any] | None = None,
                      max_tokens_cap: int | None = None, tokenizer: Any = None) -> tuple[list[str | list[int]], SamplingParams]:
    """The prompts (one engine request each) and the sampling parameters of a completion request. Its
    max_tokens is vLLM's: 16 unless given; given as null, the model's default, else up to the context;
    either way at most `max_tokens_cap`. With `add_special_tokens: false` a text prompt is tokenized here,
    without the tokenizer's special tokens (where it would add any)."""
    if req.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of ({req.best_of}) different from n ({req.n}) is not supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if not req.add_special_tokens and tokenizer is not None:
        prompts = [without_special_tokens(p, tokenizer) for p in prompts]
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set and req.min_tokens > COMPLETION_MAX_TOKENS:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens, which is {COMPLETION_MAX_TOKENS} on "
                          "/v1/completions unless given (as in OpenAI's API and vLLM); give max_tokens (null: the "
                          "model's default, else up to the context)", param="min_tokens")
    if max_tokens is None:
        max_tokens = (defaults or {}).get("max_tokens")
    max_tokens = capped(max_tokens, max_tokens_cap)
    if req.echo and max_tokens == 0:
        if req.logprob_token_ids and req.logprobs is not None:  # as vLLM: the prompt's log-probs are its own
            raise bad_request("logprob_token_ids scores output tokens, and max_tokens 0 with echo makes none",
                              param="logprob_token_ids")
        max_tokens = 1  # the prompt alone: the engine still makes a token, which the answer leaves out
    params = sampling_params(req, max_tokens, req.logprobs, max_n=max_n, defaults=defaults)
    if req.echo and req.logprobs is not None:
        if req.prompt_logprobs not in (None, req.logprobs):
            raise bad_request(f"with echo, the prompt's alternatives are logprobs' ({req.logprobs}); prompt_logprobs "
                              f"({req.prompt_logprobs}) must equal it or be left out", param="prompt_logprobs")
        params = params.clone(prompt_logprobs=req.logprobs)
    return prompts, params


def without_special_tokens(prompt: str | list[int], tokenizer: Any) -> str | list[int]:
    """A text prompt's ids without the tokenizer's special tokens; the text itself where the tokenizer
    adds none (so that `echo` repeats it as sent)."""
    if not isinstance(prompt, str):
        return prompt
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return prompt if ids == tokenizer.encode(prompt) else ids


def message_dict(i: int, m: ChatMessage, content_format: ContentFormat = "string") -> dict[str, Any]:
    """A message as the chat template expects it, other than text parts refused: its content a string
    (the text parts joined with newlines) or, for a template that reads OpenAI's shape, the list of text
    parts (a string is one part; a tool's answer stays a string, as vLLM gives it)."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"content part of type {part.type!r} is not supported (text only)",
                                  param=f"messages.{i}.content.{j}")
            texts.append(part.text)
    elif content is None:
        # clients send an assistant turn without text after tool calls; the template gets empty text
        if m.role != "assistant":
            raise bad_request(f"messages.{i}.content is null; only an assistant message may have no content",
                              param=f"messages.{i}.content")
        texts = []
    else:
        texts = [content]
    if content_format == "openai" and m.role != "tool":
        content = [{"type": "text", "text": t} for t in texts]
    else:
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None and m.role == "assistant":  # Qwen3's templates render it after the last user turn,
        # gpt-oss's (as `thinking`) before a tool call no final answer follows, as vLLM's harmony rendering keeps it
        out["reasoning"] = out["reasoning_content"] = out["thinking"] = reasoning
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls: only an assistant message makes tool calls",
                              param=f"messages.{i}.tool_calls")
        # templates read the arguments as an object (transformers' convention; vLLM converts the same way)
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name,
            "arguments": arguments_object(c.function.arguments)}} for c in m.tool_calls]
    return out


def chat_inputs(req: ChatCompletionRequest, tokenizer: Any, max_n: int = DEFAULT_MAX_N,
                plan: ToolPlan | None = None, defaults: Mapping[str, Any] | None = None,
                max_tokens_cap: int | None = None, rendering: ChatRendering = MODEL_TEMPLATE
                ) -> tuple[list[int], SamplingParams]:
    """The chat template applied to the messages and `plan`'s tools (as token ids) and the sampling
    parameters, constrained to tool calls when the plan requires them; `rendering` is the server's
    template and content format (`server/chat_template_flags.py`)."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_completion_tokens or max_tokens, not both", param="max_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = (defaults or {}).get("max_tokens")  # else up to the context
    max_tokens = capped(max_tokens, max_tokens_cap)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.echo not in (None, False):
        raise bad_request("echo is not supported on chat completions (it is on /v1/completions)", param="echo")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs, renames={"logprobs": "top_logprobs"}, max_n=max_n,
                             defaults=defaults)
    constraint = tool_constraint(plan, req.parallel_tool_calls)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise bad_request(f'tool_choice {plan.mode!r} constrains the output to tool calls; it cannot be combined '
                              "with response_format or structured outputs", param="tool_choice")
        params = params.clone(structured_outputs=constraint)
    tools = plan.tool_dicts() if plan is not None else None
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(CONTINUE_NEEDS_NO_GENERATION_PROMPT, param="continue_final_message")
    template_kwargs = dict(req.chat_template_kwargs or {})
    for name in ("documents", "reasoning_effort"):  # vLLM's template variables, over chat_template_kwargs'
        if getattr(req, name) is not None:
            template_kwargs[name] = getattr(req, name)
    rendering = rendering.for_request(req.chat_template, req.chat_template_kwargs)
    return chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt, tools,
                           continue_final_message=req.continue_final_message, template_kwargs=template_kwargs,
                           add_special_tokens=req.add_special_tokens, rendering=rendering), params


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
                    rendering: ChatRendering = MODEL_TEMPLATE) -> list[int]:
    """The prompt's token ids; a template that knows nothing of tools gets them in Hermes' format.
    `continue_final_message` (vLLM's, transformers' rule) ends the prompt right after the final
    message's text, so the model continues it; `template_kwargs` are vLLM's `chat_template_kwargs` (with
    its `documents`); `add_special_tokens` (vLLM's, off by default: the template writes its own) adds the
    tokenizer's around the rendered text. `rendering` chooses the template (the server's over the
    model's) and the shape of a message's content."""
    templates = rendering.templates(tokenizer)
    if tokenizer is None or templates is None:
        raise bad_request(NO_TEMPLATE, param="messages")
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    extra = {k: v for k, v in (template_kwargs or {}).items()
             if k not in ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                          "special_tokens", "continue_final_message")}
    try:
        uses_tools = tools or any(m.role == "tool" or m.tool_calls for m in messages)
        hermes = bool(uses_tools) and not template_handles_tools(select_chat_template(templates, None, tools))
        source = select_chat_template(templates, None, None if hermes else tools)
        content_format = rendering.format_for(source)
        dicts = [message_dict(i, m, "string" if hermes else content_format) for i, m in enumerate(messages)]
        if hermes:  # the Hermes rewrite writes text; a template that reads parts gets it as one part
            dicts, tools = with_hermes_tools(dicts, tools or []), None
            if content_format == "openai":
                dicts = [{**d, "content": [{"type": "text", "text": d["content"]}]} for d in dicts]
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                             continue_final_message=continue_final_message, chat_template=source,
                                             **extra)
    except ValueError as e:
        param = "continue_final_message" if str(e).startswith("continue_final_message") else "messages"
        raise bad_request(f"the chat template failed on these messages: {e}", param=param) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenizer_config(tokenizer: Any, max_model_len: int, rendering: ChatRendering = MODEL_TEMPLATE) -> dict[str, Any]:
    """What /tokenizer_info answers: tokenizer_config.json's keys with the special tokens and the chat
    template filled in (clients such as lm-evaluation-harness read the template and EOS from it): the
    server's `--chat-template` where it has one, as vLLM answers."""
    config = {k: v for k, v in tokenizer.config.items() if k not in ("added_tokens_decoder", "tokenizer_file")}
    config.update(tokenizer.special_tokens)
    config["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    config["model_max_length"] = max_model_len
    templates = rendering.templates(tokenizer)
    if isinstance(templates, dict) and "default" not in templates:  # as tokenizer_config.json lists several
        config["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    elif templates is not None:
        config["chat_template"] = select_chat_template(templates)
    return config


def answer_decoding(plan: ToolPlan | None, thinking: Any, params: SamplingParams
                    ) -> tuple[ToolPlan | None, SamplingParams]:
    """A chat request's tool plan and the sampling parameters its engine request decodes with. An answer
    whose readers look for special tokens keeps them in its text, as vLLM's parsers ask: an `auto` tool
    choice under a parser whose markers are special tokens in the models that write them (`[TOOL_CALLS]`,
    `<|python_tag|>`, harmony's), or a reasoning parser that reads them (`ReasoningPlan.keeps_special_tokens`:
    gpt-oss's harmony, Mistral's `[THINK]`). Only the engine request changes: the answer's log-probs,
    usage and finish are the request's own (`params` names its log-probs' tokens). An answer a grammar
    writes beside an auto tool choice is plain text, not harmony: the `openai` parser reads nothing of
    it, so it is all content, as under `openai_gptoss`."""
    auto = plan is not None and plan.mode == "auto" and plan.parser is not None
    if auto and plan.parser == "openai" and params.structured_outputs is not None:
        plan, auto = dataclasses.replace(plan, parser=None), False
    reads = (auto and TOOL_PARSERS[plan.parser].keeps_special_tokens) or \
        (thinking is not None and thinking.keeps_special_tokens)
    return plan, params.clone(skip_special_tokens=False) if reads else params
