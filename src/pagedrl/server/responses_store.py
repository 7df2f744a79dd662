"""Stored responses, for `GET /v1/responses/{id}` and `previous_response_id`: in memory, bounded.

As in vLLM, a server keeps responses only when started so (`--enable-responses-store`; vLLM's
`VLLM_ENABLE_RESPONSES_API_STORE`); otherwise a request's `store` is ignored and nothing can be
fetched or continued. Unlike vLLM's store, which grows until the process ends, this one holds at
most `max_bytes` (the size of each response's JSON and of its conversation's): past that the oldest
responses are forgotten first, and an id forgotten answers 404 as one never seen. Each entry keeps
the whole conversation so far, so a chain costs what each of its turns holds, and a later turn
never depends on an earlier one still being kept. A background stream's response keeps its events too
(`responses_background.py`), so it can be streamed again; they count in its size.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedrl.server.env_flags import env_flag
from pagedrl.server.responses_bodies import ResponseObject

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"  # vLLM's switch, read as it reads it


def responses_store_from_env() -> bool:
    return env_flag(RESPONSES_STORE_ENV)


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages, the answer's own last; no instructions
    size: int
    events: tuple[bytes, ...] | None = None  # a background stream's, each event whole


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"the responses store needs at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]],
            events: Sequence[bytes] | None = None) -> None:
        """Keep `response`, forgetting the oldest past the bound (one larger than it is not kept, a warning
        says so). A background stream's `events` that would take it past the bound alone are dropped and
        the response kept without them: what a client polling it asks for is the response."""
        size = len(response.model_dump_json().encode()) + len(json.dumps(conversation, ensure_ascii=False).encode())
        if events and size + sum(len(e) for e in events) > self.max_bytes:
            logger.warning("response %s: its %d stream events would pass --responses-store-bytes %d; kept "
                           "without them (a GET can no longer stream it again)", response.id, len(events), self.max_bytes)
            events = None
        size += sum(len(e) for e in events or ())
        if size > self.max_bytes:
            logger.warning("response %s: %d bytes, more than --responses-store-bytes %d; not kept",
                           response.id, size, self.max_bytes)
            return
        self.delete(response.id)
        self.entries[response.id] = StoredResponse(response, conversation, size,
                                                   tuple(events) if events is not None else None)
        self.size += size
        while self.size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.size -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self.entries.pop(response_id, None)
        if old is not None:
            self.size -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self.entries)
