"""A real `fak serve` as a separate process, from a TOML config written for the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from governor.auth import sha256_hex
from tests.http_client import HTTP

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"fak: serving on (\S+) \(metrics on (\S+)\)")


@dataclass
class FakServe:
    url: str
    metrics_url: str
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def write_config(path: Path, server: dict[str, Any], engine: dict[str, Any],
                 tenants: dict[str, dict[str, Any]], admin_token: str) -> None:
    """`tenants` maps an API key to the tenant's table (id, class, limits)."""
    lines = ["[server]"] + [f"{k} = {toml_value(v)}" for k, v in server.items()]
    lines.append(f"admin_token_sha256 = {toml_value(sha256_hex(admin_token))}")
    lines += ["", "[engine]"] + [f"{k} = {toml_value(v)}" for k, v in engine.items()]
    for key, table in tenants.items():
        lines += ["", "[[tenants]]", f"api_key_sha256 = [{toml_value(sha256_hex(key))}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")


def start_fak_serve(config: Path, data_dir: Path, timeout_s: float = 300.0) -> FakServe:
    log_path = data_dir.parent / f"fak-serve-{data_dir.name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "governor.cli", "serve", "--config", str(config),
             "--port", "0", "--metrics-port", "0", "--data-dir", str(data_dir), "--init-key"],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = SERVING.search(log_path.read_text(errors="replace"))
        if found:
            served = FakServe(found.group(1), found.group(2), data_dir, log_path, proc)
            if HTTP.get(served.url + "/health", timeout=10).status_code in (200, 503):
                return served
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_fak_serve(FakServe("", "", data_dir, log_path, proc))
    raise RuntimeError(f"fak serve did not start; log:\n{log_path.read_text()[-4000:]}")


def stop_fak_serve(served: FakServe, grace_s: float = 20.0) -> None:
    if served.process.poll() is None:
        os.killpg(served.process.pid, signal.SIGTERM)
        try:
            served.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(served.process.pid, signal.SIGKILL)
            served.process.wait()
