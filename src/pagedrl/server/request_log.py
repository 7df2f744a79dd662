"""vLLM's `--enable-log-requests` and `--max-log-len`: one INFO line per engine request as it is accepted.

An operator tracing a bad answer needs to know what the server was asked: the line names the request
by the id its response carries (`chatcmpl-...`, `cmpl-...`, `resp_...`; with `-i` for the i-th prompt
of a completion request with several), and says its sampling parameters and adapter. The prompt itself
(text and token ids) is logged only at DEBUG, as in vLLM, since prompts are often private and long;
`--max-log-len` keeps that many characters and ids of it. Off by default: nothing is logged per request.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.sampling_params import SamplingParams

logger = logging.getLogger("pagedrl.server.requests")


def add_request_log_arguments(group: argparse._ArgumentGroup) -> None:
    """vLLM's two flags."""
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it is accepted: its id, sampling parameters and adapter (INFO), "
                            "its prompt (DEBUG)")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="with --enable-log-requests, the most prompt characters and token ids logged "
                            "(default: all)")


@dataclass(frozen=True)
class RequestLog:
    enabled: bool = False
    max_log_len: int | None = None  # None: the whole prompt

    def received(self, request_id: str, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]],
                 params: SamplingParams, lora: LoRARequest | None, tokenizer: Any = None) -> None:
        """Log the engine requests of one API call: `prompts` as given (text or ids), `prompt_ids` as the
        engine took them."""
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
