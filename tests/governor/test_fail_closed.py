"""SEC-18: refuse to start without a usable key; engine down → 5xx while the governor lives."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.native import NativeDriver
from governor.auth import sha256_hex
from governor.cli import main
from governor.config import parse_config
from governor.secrets import SALT_KEY_FILE, StartupRefused
from governor.serve import build_governor
from tests.http_client import HTTP

from .server_thread import ServerThread

KEY = "key-acme"


def _config(data_dir: Path, **server: object):
    return parse_config({"server": {"data_dir": str(data_dir), **server},
                         "engine": {"kind": "native"},
                         "tenants": [{"id": "acme", "api_key_sha256": [sha256_hex(KEY)],
                                      "max_concurrency": 1}]})


def test_missing_key_refused_unless_initialised(tmp_path: Path) -> None:
    with pytest.raises(StartupRefused, match="missing"):
        build_governor(_config(tmp_path), NativeDriver(), create_key=False)
    build_governor(_config(tmp_path), NativeDriver(), create_key=True)
    assert (tmp_path / SALT_KEY_FILE).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("content", [b"", b"short", None])
def test_unusable_key_refused(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / SALT_KEY_FILE
    if content is None:
        path.mkdir()  # unreadable as a file, even for root
    else:
        path.write_bytes(content)
    with pytest.raises(StartupRefused):
        build_governor(_config(tmp_path), NativeDriver(), create_key=True)


def test_cli_refuses_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "fak.toml"
    cfg.write_text(f'[server]\ndata_dir = "{tmp_path / "data"}"\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "salt key" in capsys.readouterr().err


def test_engine_down_answers_503_and_governor_stays_up(tmp_path: Path) -> None:
    thread = ServerThread()
    try:
        gov = build_governor(_config(tmp_path, admission_wait_s=0.1), NativeDriver(),
                             create_key=True)
        url = thread.serve(gov)
        auth = {"Authorization": f"Bearer {KEY}"}
        for _ in range(3):
            r = HTTP.post(url + "/v1/completions", json={"prompt": "hi"}, headers=auth)
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
        health = HTTP.get(url + "/health")
        assert health.status_code == 503 and health.json()["engine_alive"] is False
        assert HTTP.get(url + "/ready").status_code == 503
        assert gov.admission.in_flight == 0
        thread.run(gov.admission.acquire("acme", 1, 0))
        r = HTTP.post(url + "/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        thread.call(lambda: gov.admission.release("acme"))
        metrics = HTTP.get(thread.metrics_urls[url] + "/metrics").text
        assert 'reason="tenant_concurrency"' in metrics
    finally:
        thread.stop()
