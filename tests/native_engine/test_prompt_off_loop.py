"""Which bodies are turned into token ids on a worker thread (native_engine.model.prompt)."""

from __future__ import annotations

from native_engine.model.prompt import (
    OFF_LOOP_CHARS,
    OFF_LOOP_IDS,
    OFF_LOOP_MESSAGES,
    off_loop,
)
from schemas.openai import parse_request


def chat(count: int, text: str = "hi") -> dict:
    return {"messages": [{"role": "user", "content": text}] * count}


def test_long_texts_many_ids_and_many_messages_go_off_the_loop() -> None:
    assert not off_loop(parse_request("completions", {"prompt": "a" * (OFF_LOOP_CHARS - 1)}))
    assert off_loop(parse_request("completions", {"prompt": "a" * OFF_LOOP_CHARS}))
    assert not off_loop(parse_request("completions", {"prompt": [1] * (OFF_LOOP_IDS - 1)}))
    assert off_loop(parse_request("completions", {"prompt": [1] * OFF_LOOP_IDS}))
    assert off_loop(parse_request("chat", chat(1, "a" * OFF_LOOP_CHARS)))
    # Short messages, but each is dumped and rendered through the template on its own.
    assert not off_loop(parse_request("chat", chat(OFF_LOOP_MESSAGES - 1)))
    assert off_loop(parse_request("chat", chat(OFF_LOOP_MESSAGES)))
