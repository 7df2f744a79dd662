"""The responses store's bound: past `max_bytes` the oldest responses are forgotten first, one larger
than the whole bound is not kept, and what is forgotten or deleted is unknown afterwards."""

from __future__ import annotations

import pytest

from pagedrl.server.responses_bodies import ResponseObject
from pagedrl.server.responses_store import ResponseStore

TURN = [{"role": "user", "content": "x" * 100}]


def size_of(response: ResponseObject) -> int:
    store = ResponseStore(1 << 20)
    store.put(response, TURN)
    return store.size


def test_the_oldest_are_forgotten_past_the_bound() -> None:
    responses = [ResponseObject(model="m") for _ in range(5)]
    one = size_of(responses[0])
    store = ResponseStore(3 * one + one // 2)  # room for three
    for r in responses:
        store.put(r, TURN)
    assert [store.get(r.id) is not None for r in responses] == [False, False, True, True, True]
    assert store.size == 3 * one <= store.max_bytes and len(store) == 3
    assert store.delete(responses[3].id) and store.get(responses[3].id) is None and store.size == 2 * one
    assert not store.delete(responses[3].id)


def test_a_response_larger_than_the_bound_is_not_kept() -> None:
    store = ResponseStore(100)
    kept = ResponseObject(model="m")
    store.put(kept, [])  # ~600 bytes of JSON: over the bound alone
    assert store.get(kept.id) is None and store.size == 0
    with pytest.raises(ValueError, match="at least 1 byte"):
        ResponseStore(0)


def test_the_bound_counts_utf8_bytes_not_characters() -> None:
    """A turn of 100 CJK characters holds 300 bytes: the bound is in bytes, as the flag says."""
    response = ResponseObject(model="m")
    ascii_size = size_of(response)
    store = ResponseStore(1 << 20)
    store.put(response, [{"role": "user", "content": "猫" * 100}])
    assert store.size == ascii_size + 200


def test_a_background_streams_events_are_kept_and_count_in_its_size() -> None:
    response = ResponseObject(model="m")
    events = [b"event: response.created\ndata: {}\n\n", b"event: response.completed\ndata: {}\n\n"]
    store = ResponseStore(1 << 20)
    store.put(response, TURN, events)
    assert store.get(response.id).events == tuple(events)
    assert store.size == size_of(response) + sum(map(len, events))


def test_events_that_would_pass_the_bound_are_dropped_and_the_response_kept() -> None:
    """A background stream's events larger than the whole store: the response a client polls for is kept,
    without them."""
    response = ResponseObject(model="m")
    one = size_of(response)
    store = ResponseStore(one + 10)
    store.put(response, TURN, [b"x" * 100])
    assert store.get(response.id).events is None and store.size == one
