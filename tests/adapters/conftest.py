"""Fixtures shared by the adapter tests."""

from __future__ import annotations

import threading

import pytest

from adapters import prompt_tokens


@pytest.fixture
def chain_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread each block-hash chain of the router was hashed on, in order."""
    seen: list[threading.Thread] = []
    real_chain = prompt_tokens.prompt_chain

    def chain(*args: object) -> list[bytes]:
        seen.append(threading.current_thread())
        return real_chain(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prompt_tokens, "prompt_chain", chain)
    return seen
