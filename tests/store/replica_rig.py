"""Three `fak serve` replicas on one PostgreSQL, riding one `fak engine serve` (the real
model), and an observer of the salts the engine sees (its KV events: the block at token 0 of
a salted request carries the salt as its extra key)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from adapters.vllm.kv_decode import decode_message
from governor.auth import sha256_hex
from schemas.kv_events import BlockStored
from tests.governor.server_thread import free_port
from tests.http_client import HTTP
from tests.integration.native_server import NativeServer

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
TENANTS = ("acme", "beta", "gamma")
DSN_ENV = "FAK_STATE_DSN"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}"}


@dataclass
class Replica:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def write_config(path: Path, name: str, port: int, data_dir: Path, key_path: Path,
                 engine: NativeServer) -> None:
    tenants = "".join(f'[[tenants]]\nid = "{t}"\napi_key_sha256 = ["{sha256_hex("key-" + t)}"]\n'
                      f"max_concurrency = 64\n" for t in TENANTS)
    path.write_text(f"""[server]
host = "127.0.0.1"
port = {port}
metrics_port = 0
data_dir = "{data_dir}"
admin_token_sha256 = "{sha256_hex(ADMIN)}"
max_engine_concurrency = 64

[engine]
kind = "vllm"
base_url = "{engine.base_url}"
model = "{engine.model}"

[audit]
signing_key_path = "{key_path}"

[state]
backend = "postgres"
dsn_env = "{DSN_ENV}"
replica_id = "{name}"

{tenants}""")


def start_replicas(root: Path, dsn: str, engine: NativeServer, count: int = 3
                   ) -> list[Replica]:
    """Replica r1 creates the keys; the others get copies (one salt key, one signing key for
    the deployment), then all start together."""
    key_path = root / "secrets" / "audit_signing.key"
    first = _launch(root, "r1", dsn, engine, key_path, init_key=True)
    _wait_serving(first)
    replicas = [first]
    salt = (root / "r1" / "salt.key").read_bytes()
    for n in range(2, count + 1):
        data = root / f"r{n}"
        data.mkdir(mode=0o700)
        (data / "salt.key").write_bytes(salt)
        (data / "salt.key").chmod(0o600)
        replicas.append(_launch(root, f"r{n}", dsn, engine, key_path, init_key=False))
    for replica in replicas[1:]:
        _wait_serving(replica)
    return replicas


def _launch(root: Path, name: str, dsn: str, engine: NativeServer, key_path: Path,
            init_key: bool) -> Replica:
    port = free_port()
    config = root / f"{name}.toml"
    write_config(config, name, port, root / name, key_path, engine)
    log_path = root / f"{name}.log"
    cmd = [sys.executable, "-m", "governor.cli", "serve", "--config", str(config)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd + (["--init-key"] if init_key else []), cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), DSN_ENV: dsn},
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Replica(name, f"http://127.0.0.1:{port}", proc, log_path)


def _wait_serving(replica: Replica, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not replica.alive():
            raise AssertionError(f"{replica.name} exited:\n{replica.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if HTTP.get(replica.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{replica.name} did not start:\n{replica.log_tail()}")


def stop_replicas(replicas: list[Replica]) -> None:
    for r in replicas:
        if r.alive():
            r.process.send_signal(signal.SIGTERM)
    for r in replicas:
        try:
            r.process.wait(30)
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()


def fresh_prompt(words: int = 48) -> str:
    """Random letters: a prompt no cache holds, at least one full engine block long."""
    rng = random.Random(time.time_ns())
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(words))


@dataclass
class SaltObserver:
    """Subscribes to the engine's KV events and reports the salt of each new first block."""

    engine: NativeServer
    ctx: zmq.Context = field(default_factory=zmq.Context)

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, self.engine.kv_topic.encode())
        self.sock.connect(self.engine.kv_endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher

    def drain(self) -> None:
        while self.sock.poll(50):
            self.sock.recv_multipart()

    def next_salt(self, timeout_s: float = 10) -> str:
        """The salt of the next stored block at token 0 (a request's first block)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            batch = decode_message(self.sock.recv_multipart())
            for ev in batch.events:
                if isinstance(ev, BlockStored) and ev.parent_block_hash is None \
                        and ev.extra_keys and ev.extra_keys[0]:
                    return str(ev.extra_keys[0][0])
        raise AssertionError("the engine stored no first block in time")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
