"""A long chat is validated and dumped in chunks (schemas.openai.MESSAGE_CHUNK): the same model,
errors and forwarded body as one pydantic call, without holding the GIL throughout."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from schemas.openai import MESSAGE_CHUNK, ChatRequest, RequestInvalid, parse_request

GOOD = (
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None},
    {"role": "system", "content": [{"type": "text", "text": "be brief"}], "name": "ops"},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
    {"role": "developer", "content": "", "name": None},
)
BAD = ({"role": "robot", "content": "x"}, {"content": 3}, "not an object",
       {"role": "user", "content": [1]})
TOP = st.fixed_dictionaries({}, optional={
    "max_tokens": st.sampled_from([3, "4", "x", None]),
    "temperature": st.sampled_from([0.5, "hot"]),
    "logprobs": st.sampled_from([True, "maybe"]),
    "echo": st.booleans(),
    "stream": st.sampled_from([False, [1]]),
    "extra_field": st.integers(),
})


@st.composite
def long_chats(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(MESSAGE_CHUNK + 1, 3 * MESSAGE_CHUNK))
    messages: list[Any] = [GOOD[i % len(GOOD)] for i in range(count)]
    for at in draw(st.lists(st.integers(0, count - 1), max_size=3)):
        messages[at] = draw(st.sampled_from(BAD))
    return {**draw(TOP), "messages": messages}


def outcome(parse: Any) -> tuple[str, Any]:
    try:
        return "ok", parse()
    except (ValidationError, RequestInvalid) as exc:
        errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) \
            else exc.errors
        return "error", [dict(e) for e in errors]


@settings(max_examples=40, deadline=None)
@given(long_chats())
def test_a_long_chat_parses_as_one_pydantic_call_would(value: dict[str, Any]) -> None:
    kind, mine = outcome(lambda: parse_request("chat", value))
    assert (kind, mine) == outcome(lambda: ChatRequest.model_validate(value))
    if kind == "ok":
        assert mine.model_fields_set == ChatRequest.model_validate(value).model_fields_set
        whole = BaseModel.model_dump(mine, mode="json", exclude_unset=True)
        wire = mine.wire()
        assert wire == whole and list(wire) == list(whole)
    else:
        assert isinstance(mine, list) and mine


def test_the_first_error_is_named_as_before() -> None:
    messages: list[Any] = [GOOD[0]] * (2 * MESSAGE_CHUNK)
    messages[MESSAGE_CHUNK + 5] = {"role": "robot"}
    with pytest.raises(RequestInvalid) as caught:
        parse_request("chat", {"messages": messages, "logprobs": "maybe"})
    assert caught.value.param == f"messages.{MESSAGE_CHUNK + 5}.role"
    assert [e["loc"][0] for e in caught.value.errors] == ["messages", "logprobs"]


def test_parsing_a_long_chat_leaves_other_threads_running() -> None:
    """60,000 messages: one pydantic call held the GIL throughout (~0.1 s here); in chunks a
    1 ms sleeper keeps ticking. The collector is off while it is timed: its full
    collections hold the GIL too, as long as the objects they walk (see docs/operations.md)."""
    value = {"messages": [dict(GOOD[i % 3]) for i in range(60_000)], "max_tokens": 1}
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            time.sleep(0.001)
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    gc.disable()
    try:
        started = time.perf_counter()
        parsed = parse_request("chat", value)
        wire = parsed.wire()
        ended = time.perf_counter()
    finally:
        gc.enable()
        stop.set()
        thread.join()
    assert len(wire["messages"]) == 60_000
    edges = [started, *(t for t in ticks if started < t < ended), ended]
    longest = max(b - a for a, b in itertools.pairwise(edges))
    took = ended - started
    print(f"\nparse + wire of 60,000 messages {took * 1000:.0f} ms, "
          f"longest wait of a 1 ms sleeper {longest * 1000:.1f} ms")
    assert longest < took / 4, (longest, took)
