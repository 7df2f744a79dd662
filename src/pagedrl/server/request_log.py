"""vLLM's `--enable-log-requests` and `--max-log-len`: one INFO line per engine request as it is accepted.

An operator tracing a bad answer needs to know what the server was asked: the line names the request
by the id its response carries (`chatcmpl-...`, `cmpl-...`, `resp_...`; with `-i` for the i-th prompt
of a completion request with several), and says its sampling parameters and adapter. The prompt itself
(text and token ids) is logged only at DEBUG, as in vLLM, since prompts are often private and long;
`--max-log-len` keeps that many characters and ids of it. Off by default: nothing is logged per request.

With `--enable-log-outputs` too (vLLM's), the answers of the chat route and of `/v1/responses` are
logged at INFO, in vLLM's words: `Generated response ID: output: ..., output_token_ids: [...],
finish_reason: ...`, each choice's text (or, for an answer that is only tool calls, `[tool_calls:
name(arguments), ...]`), cut to `--max-log-len` as the prompt is. A chat stream logs each delta as it
goes out (`ID (streaming delta)`) and, at its end, each choice's whole text (`ID (streaming complete)`,
finish_reason `streaming_complete`), as vLLM does; a Responses stream logs only its end.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedrl.engine.beam_search import BeamSearchParams
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.sampling_params import SamplingParams

logger = logging.getLogger("pagedrl.server.requests")


def add_request_log_arguments(group: argparse._ArgumentGroup) -> None:
    """vLLM's two flags."""
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it is accepted: its id, sampling parameters and adapter (INFO), "
                            "its prompt (DEBUG)")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="with --enable-log-requests, the most prompt (and output) characters and token ids "
                            "logged (default: all)")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="with --enable-log-requests, log each chat and Responses answer too: its text, token ids "
                            "and finish reason (INFO)")


@dataclass(frozen=True)
class RequestLog:
    enabled: bool = False
    max_log_len: int | None = None  # None: the whole prompt
    outputs: bool = False  # --enable-log-outputs (only with `enabled`, as in vLLM)

    @property
    def logs_outputs(self) -> bool:
        """Whether answers are logged at all: a stream keeps its choices' texts only then."""
        return self.enabled and self.outputs

    def received(self, request_id: str, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]],
                 params: SamplingParams | BeamSearchParams, lora: LoRARequest | None, tokenizer: Any = None) -> None:
        """Log the engine requests of one API call: `prompts` as given (text or ids), `prompt_ids` as the
        engine took them; a beam search's with its BeamSearchParams, once, not each of its steps'."""
        if not self.enabled:
            return
        for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
            name = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            if logger.isEnabledFor(logging.DEBUG):
                text = prompt if isinstance(prompt, str) else (
                    tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else None)
                cut = self.max_log_len
                logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s", name,
                             text if cut is None or text is None else text[:cut], list(ids if cut is None else ids[:cut]))
            logger.info("Received request %s: params: %s, lora_request: %s.", name, params, lora)

    def generated(self, request_id: str, output: str, token_ids: Sequence[int] | None, finish_reason: str | None,
                  streaming: bool = False, delta: bool = False) -> None:
        """Log an answer (vLLM's RequestLogger.log_outputs): a whole choice's, a streamed delta's, or at the
        end of a stream a choice's whole text (`streaming`, not `delta`; its ids are not kept, as in vLLM)."""
        if not self.logs_outputs or not output:
            return
        cut = self.max_log_len
        ids = None if token_ids is None else list(token_ids if cut is None else token_ids[:cut])
        tag = "" if not streaming else " (streaming delta)" if delta else " (streaming complete)"
        logger.info("Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s", request_id, tag,
                    output if cut is None else output[:cut], ids, finish_reason)


def answer_text(content: str | None, calls: Sequence[tuple[str, str]] = ()) -> str:
    """What vLLM logs of an answer: its text, else its tool calls as `[tool_calls: name(arguments), ...]`."""
    if content:
        return content
    return f"[tool_calls: {', '.join(f'{name}({arguments})' for name, arguments in calls)}]" if calls else ""


def delta_text(content: str | None, arguments: str) -> str:
    """What vLLM logs of a streamed delta: its text, then `[tool_calls: arguments]` when it has some."""
    return " ".join([*([content] if content else []), *([f"[tool_calls: {arguments}]"] if arguments else [])])
