"""SEC-16 on a real `fak serve` process: an upstream whose isolation fails its probes
refuses start-up with one clear line (exit 2), against a loopback server answering like
vLLM 0.32 but hashing with xxhash, or accepting any salt."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.adapters.vllm_imitation import Imitation, start_imitation
from tests.governor.fak_serve_process import REPO_ROOT, write_config


async def fak_serve_exit(tmp_path: Path, base_url: str) -> tuple[int, list[str]]:
    config = tmp_path / "fak.toml"
    write_config(config, {}, {"kind": "vllm", "base_url": base_url}, {"k-a": {"id": "a"}},
                 "admin-token")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "governor.cli", "serve", "--config", str(config), "--port", "0",
        "--metrics-port", "0", "--data-dir", str(tmp_path / "data"), "--init-key",
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, err.decode().strip().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize(("state", "needle"), [
    (Imitation(hash_algo="xxhash"), "hashes prefix-cache blocks with xxhash"),
    (Imitation(validates_salts=False), "does not validate, so does not honour"),
], ids=["xxhash", "no-salt-validation"])
async def test_fak_serve_refuses_an_upstream_that_does_not_isolate(
        tmp_path: Path, state: Imitation, needle: str) -> None:
    runner, base_url = await start_imitation(state)
    try:
        code, lines = await fak_serve_exit(tmp_path, base_url)
    finally:
        await runner.cleanup()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("fak: upstream refused: "), lines
    assert needle in lines[0] and base_url not in lines[0]


@pytest.mark.slow
async def test_fak_serve_refuses_a_kv_endpoint_off_loopback(tmp_path: Path) -> None:
    """SEC-17 on the real process: a subscriber bind on every interface refuses start-up
    in one line unless `allow_remote_kv` is set."""
    config = tmp_path / "fak.toml"
    write_config(config, {}, {"kind": "vllm", "base_url": "http://127.0.0.1:9",
                              "kv_events": "tcp://0.0.0.0:5557"},
                 {"k-a": {"id": "a"}}, "admin-token")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "governor.cli", "serve", "--config", str(config), "--port", "0",
        "--data-dir", str(tmp_path / "data"), "--init-key", cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "every interface" in lines[0] and "allow_remote_kv" in lines[0]


@pytest.mark.slow
async def test_fak_serve_refuses_a_kv_endpoint_it_cannot_bind(tmp_path: Path) -> None:
    """A KV-event address already taken refuses start-up in one line naming it, not a
    traceback (the subscriber binds `tcp://127.0.0.1:P`; a socket here holds P)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        config = tmp_path / "fak.toml"
        write_config(config, {}, {"kind": "vllm", "base_url": "http://127.0.0.1:9",
                                  "kv_events": endpoint}, {"k-a": {"id": "a"}}, "admin-token")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "governor.cli", "serve", "--config", str(config), "--port",
            "0", "--metrics-port", "0", "--data-dir", str(tmp_path / "data"), "--init-key",
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("fak: upstream refused: KV events: cannot bind "), lines
    assert lines[0].endswith(f"cannot bind {endpoint}: Address already in use"), lines
