"""Tool calling on /v1/chat/completions, the request side: what the model is shown and what it may say.

As vLLM does it:
- the tools go to the chat template (`tools=`, as transformers' `apply_chat_template`), assistant
  `tool_calls` in the history with their arguments as objects, `tool` turns as they are;
- `tool_choice: "auto"` (the default when tools are given) lets the model answer or call, and the
  server's tool parser (`--tool-call-parser`, needs `--enable-auto-tool-choice`) reads its calls;
- `"required"` and a named function constrain decoding, through the structured-outputs machinery, to
  calls valid under the tools' JSON schemas (vLLM's encodings: a JSON array of
  `{"name", "parameters"}` for required, the arguments object for a named function), so they parse;
- `"none"` shows the tools and reads nothing.

A template that never mentions `tools` (SmolLM2's, for one) would drop them silently; for it the
tools are written into the system turn in the Hermes format (Qwen2.5's wording), and tool turns and
past calls are rendered as Hermes' `<tool_response>` and `<tool_call>` blocks, so every model is
told about its tools in the format the `hermes` parser reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedrl.engine.json_schema import relocated
from pagedrl.engine.structured_outputs import StructuredOutputsParams
from pagedrl.server.errors import bad_request
from pagedrl.server.protocol import ChatCompletionRequest, ChatTool

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass
class ToolPlan:
    """What a request asked of its tools."""

    mode: str  # none, auto, required or named
    tools: list[ChatTool] = field(default_factory=list)
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the tool parser's name

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or {"type": "object", "properties": {}}


def tool_plan(req: ChatCompletionRequest, tool_parser: str | None, enable_auto_tool_choice: bool) -> ToolPlan | None:
    """The request's tools and choice, checked (400s name `tools.i...` / `tool_choice`); None without tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}]: a second function named {name!r}", param=f"tools.{i}.function.name")
    if choice is None or choice == "auto":
        if not enable_auto_tool_choice or tool_parser is None:
            raise bad_request('"auto" tool choice (the default with tools) needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser; or ask for tool_choice "
                              '"required", "none" or a named function', param="tool_choice")
        return ToolPlan("auto", list(req.tools), parser=tool_parser)
    if isinstance(choice, str):
        return ToolPlan(choice, list(req.tools))
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice.function.name")
    return ToolPlan("named", list(req.tools), name=choice.function.name)


def check_tool_schemas(plan: ToolPlan, compile_check: Any) -> None:
    """Compile the parameters schema of every tool the plan constrains the output to (all of them
    under `required`, the named one under a named choice; `compile_check(StructuredOutputsParams)`
    raises ValueError): a bad one is a 400 naming `tools[i].function.parameters`. Under `auto` and
    `none` nothing is constrained, so nothing is compiled (a schema keyword the grammar does not build,
    such as `uniqueItems`, is no reason to refuse them, as vLLM does not)."""
    for i, tool in enumerate(plan.tools):
        where = f"tools[{i}].function.parameters"
        schema = tool.function.parameters
        if schema is None:
            continue
        if schema.get("type", "object") != "object":
            raise bad_request(f"{where}: the arguments of a function are a JSON object; the schema's type is "
                              f"{schema.get('type')!r}", param=f"tools.{i}.function.parameters")
        if not (plan.mode == "required" or (plan.mode == "named" and tool.function.name == plan.name)):
            continue
        try:
            compile_check(StructuredOutputsParams(json=schema))
        except ValueError as e:
            message = str(e).replace("structured_outputs.json", where, 1)
            raise bad_request(message if where in message else f"{where}: {message}",
                              param=f"tools.{i}.function.parameters") from None


def tool_constraint(plan: ToolPlan | None, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The decoding constraint of `required` (a JSON array of calls) or a named function (its
    arguments object); None for `auto` and `none`. Like every JSON schema constraint, the tools'
    schemas allow only the properties they list unless they say otherwise (`engine/json_schema.py`):
    a call ends once the model has filled in what the schema lists, where a small model free to add
    keys goes on adding them until max_tokens."""
    if plan is None or plan.mode in ("auto", "none"):
        return None
    if plan.mode == "named":
        return StructuredOutputsParams(json=plan.parameters(plan.name), disable_any_whitespace=True)
    # Each tool's schema sits under $defs, its own `#...` pointers (pydantic's `#/$defs/Model`, a
    # recursive `#`) rewritten to start there, so they mean what they meant in the tool alone.
    defs = {f"tool{i}": relocated(plan.parameters(t.function.name), f"#/$defs/tool{i}")
            for i, t in enumerate(plan.tools)}
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(plan.tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def template_handles_tools(source: str) -> bool:
    return "tools" in source


def arguments_object(text: str) -> Any:
    """A history call's `arguments` (JSON text, as OpenAI clients send it) as the object templates
    expect; text that is not JSON is passed on as it is (the template shows what the client sent)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def hermes_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def with_hermes_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tools in the system turn, tool turns
    as `<tool_response>` user turns and past calls as `<tool_call>` text (Qwen2.5's rendering)."""
    listing = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
