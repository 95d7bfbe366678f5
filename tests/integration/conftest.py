"""The session's engines behind vLLM's surfaces: one real vLLM CPU server (see
vllm_server.py for what it is and costs) and one `fak engine serve` (native_server.py);
`engine_server` runs a test against each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .native_server import (
    NativeServer,
    NativeServerConfig,
    NativeServerError,
    start_native_server,
    stop_native_server,
)
from .vllm_server import (
    VllmServer,
    VllmServerConfig,
    VllmServerError,
    start_vllm_server,
    stop_vllm_server,
)


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VllmServer]:
    """Started once per session, stopped at its end. A failure to install, convert or
    start fails the requesting tests with the log tail; it never skips them."""
    try:
        server = start_vllm_server(VllmServerConfig.from_env())
    except VllmServerError as exc:
        pytest.fail(f"real vLLM server unavailable: {exc}", pytrace=False)
    try:
        yield server
    finally:
        stop_vllm_server(server)


@pytest.fixture(scope="session")
def native_vllm_server() -> Iterator[NativeServer]:
    """`fak engine serve` in its own process, flagged like the vLLM server."""
    try:
        server = start_native_server(NativeServerConfig())
    except NativeServerError as exc:
        pytest.fail(f"native server unavailable: {exc}", pytrace=False)
    try:
        yield server
    finally:
        stop_native_server(server)


@pytest.fixture(params=["vllm", "native"])
def engine_server(request: pytest.FixtureRequest) -> VllmServer | NativeServer:
    """The same test against the real vLLM and against `fak engine serve`."""
    name = "vllm_server" if request.param == "vllm" else "native_vllm_server"
    return request.getfixturevalue(name)
