"""`fak engine serve` on a port it cannot have (its HTTP port, its KV-event PUB port) exits 2
with one line saying which and why, no traceback (a real process, a real socket holding the
port)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from tests.governor.server_thread import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_serve(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "native_engine.serve.server", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.slow
def test_an_http_port_in_use_is_refused_in_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, lines = engine_serve("--port", str(port))
    assert code == 2, lines
    assert lines[-1] == f"fak engine serve: cannot listen on 127.0.0.1:{port}: " \
                        "Address already in use", lines
    assert not any("Traceback" in line for line in lines), lines


@pytest.mark.slow
def test_a_kv_event_port_in_use_is_refused_in_one_line() -> None:
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        kv = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}"}
        code, lines = engine_serve("--port", str(free_port()),
                                   "--kv-events-config", json.dumps(kv))
    finally:
        holder.close(linger=0)
        ctx.term()
    assert code == 2, lines
    assert lines[-1] == (f"fak engine serve: KV events: cannot bind tcp://127.0.0.1:{port}: "
                         "Address already in use"), lines
    assert not any("Traceback" in line for line in lines), lines
