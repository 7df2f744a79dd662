"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of the Hermes,
Qwen2.5 and SmolLM-style templates (and of the fallback `server/tools.py` writes for a template without
tools). Text outside the blocks is the message's content; a block whose JSON does not parse stays in the
content as written (tags included) rather than becoming an invented call, and a block still open when
the answer ends is read as it stands."""

from __future__ import annotations

from pagedrl.server.tool_parsers.reader import WAIT, CallReader, Step, called, content_until, fail, json_call

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class HermesReader(CallReader):
    keeps_special_tokens = True  # `<tool_call>` is a special token in some tokenizers (vLLM's hermes parser)

    def scan(self, text: str, final: bool) -> Step:
        if not text.startswith(TOOL_CALL_START):
            return content_until(text, final, TOOL_CALL_START)
        end = self.find_end(text, TOOL_CALL_END, len(TOOL_CALL_START))
        if end < 0 and not final:
            return WAIT
        size = len(text) if end < 0 else end + len(TOOL_CALL_END)
        call = json_call(text[len(TOOL_CALL_START):len(text) if end < 0 else end])
        return fail(size) if call is None else called(size, call)
