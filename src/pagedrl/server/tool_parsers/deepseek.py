"""The calls of the DeepSeek-V3 architecture's models, each a block between two markers, the blocks
between two more:

- `deepseek_v3`, DeepSeek-V3's (and DeepSeek-R1-0528's):

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      {...}
      ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

- `deepseek_v31`, DeepSeek-V3.1's: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` between
  the same two markers;
- `kimi_k2`, Kimi K2's: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`, the call's id
  (`functions.NAME:0`) its id in the answer, as vLLM gives it (Kimi's template writes it back).

Text before the calls is the content, as in vLLM. Each call is given out once its end marker is written;
a call block that does not parse stays in the content as written.
"""

from __future__ import annotations

import re

from pagedrl.server.tool_parsers.reader import (
    WAIT,
    CallReader,
    Step,
    called,
    content_until,
    fail,
    hold,
    object_text,
    skip,
)

V3_CALL = re.compile(r"[^\n]*?<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```", re.DOTALL)  # type, name, arguments
V31_CALL = re.compile(r"([^\n<]+)<｜tool▁sep｜>(.*)", re.DOTALL)  # name, arguments
KIMI_CALL = re.compile(r"\s*((?:[^\s<]+\.)?([^\s.<:]+):\d+)\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


class DeepSeekV3Reader(CallReader):
    keeps_special_tokens = True  # the markers are added tokens; decoded with them, whatever their flags
    section = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"

    def read_call(self, block: str) -> tuple[str, ...] | None:
        """(name, arguments) of the text between a call's markers, and its id where it gives one."""
        found = V3_CALL.fullmatch(block)
        arguments = None if found is None else object_text(found.group(2))
        return None if arguments is None else (found.group(1).strip(), arguments)

    def scan(self, text: str, final: bool) -> Step:
        for marker in self.section:  # kept back: gone when calls come, content otherwise
            if text.startswith(marker):
                return skip(len(marker)) if marker == self.section[1] and self.after_call else hold(len(marker))
        if not text.startswith(self.call[0]):
            return content_until(text, final, *self.section, self.call[0])
        end = self.find_end(text, self.call[1], len(self.call[0]))
        if end < 0:
            return WAIT
        size = end + len(self.call[1])
        call = self.read_call(text[len(self.call[0]):end])
        return fail(size) if call is None else called(size, call)


class DeepSeekV31Reader(DeepSeekV3Reader):
    def read_call(self, block: str) -> tuple[str, ...] | None:
        found = V31_CALL.fullmatch(block)
        arguments = None if found is None else object_text(found.group(2))
        return None if arguments is None else (found.group(1).strip(), arguments)


class KimiK2Reader(DeepSeekV3Reader):
    section = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call = "<|tool_call_begin|>", "<|tool_call_end|>"

    def read_call(self, block: str) -> tuple[str, ...] | None:
        found = KIMI_CALL.fullmatch(block)
        arguments = None if found is None else object_text(found.group(3))
        return None if arguments is None else (found.group(2), arguments, found.group(1))
