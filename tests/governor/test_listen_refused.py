"""A real `fak serve` whose tenant or metrics port is taken refuses start-up in one line
(exit 2), with no traceback; what it had opened is closed (its audit log is left verifiable
and the port it did bind is free again)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from governor.audit.verify import verify
from tests.adapters.vllm_imitation import Imitation, start_imitation
from tests.governor.fak_serve_process import REPO_ROOT, write_config
from tests.governor.server_thread import free_port


@pytest.mark.slow
@pytest.mark.parametrize("taken", ["port", "metrics port"])
async def test_fak_serve_refuses_a_port_in_use(tmp_path: Path, taken: str) -> None:
    runner, base_url = await start_imitation(Imitation())
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            held = holder.getsockname()[1]
            other = free_port()
            port, metrics_port = (held, other) if taken == "port" else (other, held)
            config = tmp_path / "fak.toml"
            write_config(config, {}, {"kind": "vllm", "base_url": base_url},
                         {"k-a": {"id": "a"}}, "admin-token")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "governor.cli", "serve", "--config", str(config),
                "--port", str(port), "--metrics-port", str(metrics_port), "--data-dir",
                str(tmp_path / "data"), "--init-key", cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await runner.cleanup()
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0] == (f"fak: cannot listen on the {taken} 127.0.0.1:{held}: "
                        "Address already in use"), lines
    with socket.socket() as again:  # the tenant port it bound first was let go
        again.bind(("127.0.0.1", other))
    assert verify(tmp_path / "data" / "audit.log").ok
