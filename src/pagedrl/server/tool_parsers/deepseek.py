"""`deepseek_v3`: DeepSeek-V3's (and DeepSeek-R1-0528's) calls,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

and `deepseek_v31`: DeepSeek-V3.1's, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` between
the same two markers.

Text before the calls is the content, as in vLLM. Each call is given out once its
`<｜tool▁call▁end｜>` is written; a call block that does not parse stays in the content as written.
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

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
CALL = re.compile(r"[^\n]*?<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```", re.DOTALL)  # type, name, arguments
CALL_V31 = re.compile(r"([^\n<]+)<｜tool▁sep｜>(.*)", re.DOTALL)  # name, arguments


class DeepSeekV3Reader(CallReader):
    keeps_special_tokens = True  # the markers are added tokens; decoded with them, whatever their flags
    call = CALL

    def scan(self, text: str, final: bool) -> Step:
        for marker in (CALLS_BEGIN, CALLS_END):  # kept back: gone when calls come, content otherwise
            if text.startswith(marker):
                return skip(len(marker)) if marker == CALLS_END and self.after_call else hold(len(marker))
        if not text.startswith(CALL_BEGIN):
            return content_until(text, final, CALLS_BEGIN, CALLS_END, CALL_BEGIN)
        end = self.find_end(text, CALL_END, len(CALL_BEGIN))
        if end < 0:
            return WAIT
        size = end + len(CALL_END)
        block = self.call.fullmatch(text, len(CALL_BEGIN), end)
        arguments = None if block is None else object_text(block.group(2))
        return fail(size) if arguments is None else called(size, (block.group(1).strip(), arguments))


class DeepSeekV31Reader(DeepSeekV3Reader):
    call = CALL_V31
