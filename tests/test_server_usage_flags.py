"""vLLM's usage flags on the app in process: `--enable-prompt-tokens-details` (the prompt's cached tokens
in usage, and nothing of it without the flag), `--enable-force-include-usage` (every stream ends with
its usage) and `--enable-server-load-tracking` with `GET /load`."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from test_server_vllm_behaviour import CHAT, app_client

from pagedrl.model.loader import load_model

LONG = "the cat sat on the mat and looked at the dog, who sat by the door and looked back at it " * 3


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


@pytest.fixture(scope="module")
def plain(loaded):
    yield from app_client(loaded)


@pytest.fixture(scope="module")
def flagged(loaded):
    yield from app_client(loaded, enable_prompt_tokens_details=True, enable_force_include_usage=True,
                          enable_server_load_tracking=True)


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_prompt_tokens_details_only_with_the_flag(plain, flagged):
    body = {"prompt": LONG, "max_tokens": 2}
    assert "prompt_tokens_details" not in plain.post("/v1/completions", json=body).json()["usage"]
    streamed = plain.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert "prompt_tokens_details" not in events(streamed.text)[-1]["usage"]
    first = flagged.post("/v1/completions", json=body).json()["usage"]
    again = flagged.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]
    chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    flagged.post("/v1/chat/completions", json=chat)
    whole = flagged.post("/v1/chat/completions", json=chat).json()["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] > 0
    final = events(flagged.post("/v1/chat/completions", json={**chat, "stream": True}).text)[-1]
    assert final["choices"] == [] and final["usage"]["prompt_tokens_details"] == whole["prompt_tokens_details"]


def test_force_include_usage_ends_every_stream_with_its_usage(plain, flagged):
    body = {"messages": CHAT, "max_tokens": 2, "stream": True}
    assert all(e.get("usage") is None for e in events(plain.post("/v1/chat/completions", json=body).text))
    last = events(flagged.post("/v1/chat/completions", json=body).text)[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    last = events(flagged.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}).text)[-1]
    assert last["usage"]["completion_tokens"] == 3


def test_load_counts_generating_requests_only_with_tracking(plain, flagged):
    assert plain.get("/load").json() == {"server_load": 0}
    seen = []
    body = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
    running = threading.Thread(target=lambda: flagged.post("/v1/completions", json=body))
    running.start()
    while running.is_alive():
        seen.append(flagged.get("/load").json()["server_load"])
        time.sleep(0.01)
    running.join()
    assert 1 in seen and flagged.get("/load").json() == {"server_load": 0}
    plain.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert plain.get("/load").json() == {"server_load": 0}
