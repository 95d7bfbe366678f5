"""`fak serve --workers N`: what N > 1 refuses, and each worker's share of the config
(governor.workers; the live multi-worker server is tests/store/test_workers.py)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from governor.cli import main
from governor.config import ConfigError, GovernorConfig, parse_config
from governor.workers import check_workers, reserve_port, worker_config

DIGEST = "b" * 64


def config(workers: int, state: str = "postgres", kind: str = "vllm",
           **tenant: Any) -> GovernorConfig:
    engine: dict[str, Any] = {"kind": kind}
    if kind == "vllm":
        engine |= {"base_url": "http://127.0.0.1:9", "model": "m"}
    return parse_config({"server": {"workers": workers, "port": 8000, "max_queued": 9,
                                    "max_connections_per_peer": 5},
                         "engine": engine, "state": {"backend": state},
                         "tenants": [{"id": "acme", "api_key_sha256": [DIGEST],
                                      "max_concurrency": 5, **tenant}]})


def test_one_worker_is_todays_governor_whatever_the_backend() -> None:
    check_workers(config(1, state="file", kind="native"))


@pytest.mark.parametrize(("change", "says"), [
    ({"state": "file"}, 'backend = "postgres"'),
    ({"kind": "native", "state": "postgres"}, "native engine"),
    ({"max_concurrency": 1}, "max_concurrency = 1"),
    ({"requests_per_s": 1.0}, "requests_per_s = 1"),
])
def test_what_workers_cannot_share_is_refused_in_one_line(change: dict[str, Any],
                                                          says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        check_workers(config(2, **change))
    assert "\n" not in str(refused.value)


def test_a_per_peer_cap_below_the_workers_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_connections_per_peer = 5 cannot give each of 6"):
        check_workers(config(6))


def test_the_cli_refuses_workers_on_the_file_backend(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "fak.toml"
    path.write_text(f'[server]\ndata_dir = "{tmp_path}"\n[engine]\nkind = "vllm"\n'
                    f'base_url = "http://127.0.0.1:9"\nmodel = "m"\n')
    assert main(["serve", "--config", str(path), "--workers", "2", "--init-key"]) == 2
    assert 'backend = "postgres"' in capsys.readouterr().err


def test_each_worker_gets_its_share_port_metrics_port_and_replica() -> None:
    whole = config(2, max_queued=7, tokens_per_min=101)
    parts = [worker_config(whole, i, 8123, "gov-a") for i in range(2)]
    assert [p.server.port for p in parts] == [8123, 8123]
    assert [p.server.metrics_port for p in parts] == [8001, 8002]  # default port + 1, + i
    assert [p.state.replica_id for p in parts] == ["gov-a-w0", "gov-a-w1"]
    assert sum(p.server.max_engine_concurrency for p in parts) == 64
    assert sum(p.server.max_queued for p in parts) == 9
    assert [p.server.max_connections_per_peer for p in parts] == [3, 2]
    acme = [p.tenants[0] for p in parts]
    assert sum(t.max_concurrency for t in acme) == 5
    assert sum(t.queue_limit for t in acme) == 7
    assert sum(t.tokens_per_min or 0 for t in acme) == 101


def test_a_reserved_port_is_shared_by_listeners_that_reuse_it() -> None:
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    listeners = []
    try:
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            listeners.append(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # a listener took it; the reserving socket never listens
    finally:
        for sock in [reserved, *listeners]:
            sock.close()
