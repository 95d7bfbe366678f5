"""`fak engine serve` as a separate process, sized and flagged like the suite's vLLM server.

It runs `python -m native_engine.serve.server` from this checkout with the same pool (65 blocks of
32 tokens), `max_model_len`, prompt-token details, priority scheduling, dev mode and KV
events (PUB bound on `tcp://*:P`, so subscribers connect; ROUTER replay on loopback), so the
adapter's integration suite can run against both engines unchanged. The object has the
attribute names of `VllmServer`. A fleet's replicas add `--data-parallel-size N` (ranks on
the KV ports + r) and `--api-key`, and can be restarted on the same ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.processes import bound_to_this_process

from .vllm_server import LOG_TAIL_CHARS, REPO_ROOT, _free_ports, _port_of, _tail


class NativeServerError(RuntimeError):
    """The native server did not become healthy."""


@dataclass(frozen=True)
class NativeServerConfig:
    cache_dir: Path = REPO_ROOT / ".fak-test-cache"
    served_model_name: str = "smollm2"
    block_size: int = 32
    num_blocks: int = 65
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None  # None: the server's default
    kv_topic: str = "kv"
    startup_timeout_s: float = 300.0
    cache_control_token: str | None = "fak-test-cache-control-token"
    data_parallel_size: int = 1
    api_key: str | None = None
    ports: tuple[int, int, int] | None = None  # http, kv, replay (None: free ones)

    def __post_init__(self) -> None:
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV pool cannot hold one max_model_len sequence")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")


@dataclass
class NativeServer:
    base_url: str
    model: str
    kv_endpoint: str
    kv_endpoint_mode: str
    kv_topic: str
    replay_endpoint: str
    block_size: int
    num_blocks: int
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)
    hf_dir: Path | None = None
    hf_source: str = "embedded-gguf"
    startup_s: float = 0.0
    cache_control_token: str | None = None
    config: NativeServerConfig | None = None

    @property
    def ports(self) -> tuple[int, int, int]:
        return (_port_of(self.base_url), _port_of(self.kv_endpoint),
                _port_of(self.replay_endpoint))

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return _tail(self.log_path, chars)

    def check_integrity(self) -> None:
        if not self.is_alive():
            raise AssertionError(f"native server {self.pid} is not running:\n{self.log_tail()}")
        ports = {_port_of(e) for e in (self.base_url, self.kv_endpoint, self.replay_endpoint)}
        if len(ports) != 3:
            raise AssertionError(f"endpoints share a port: {ports}")


def server_command(config: NativeServerConfig, http_port: int, kv_port: int,
                   replay_port: int) -> list[str]:
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{kv_port}",
                 "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": config.kv_topic}
    budget = ([] if config.max_num_batched_tokens is None
              else ["--max-num-batched-tokens", str(config.max_num_batched_tokens)])
    return [
        sys.executable, "-m", "native_engine.serve.server",
        "--host", "127.0.0.1", "--port", str(http_port),
        "--served-model-name", config.served_model_name,
        "--max-model-len", str(config.max_model_len),
        "--block-size", str(config.block_size),
        "--num-gpu-blocks-override", str(config.num_blocks),
        "--enable-prompt-tokens-details",
        "--scheduling-policy", "priority",
        "--kv-events-config", json.dumps(kv_events),
        "--dev-mode",
        *(["--enable-cache-control"] if config.cache_control_token else []),
        *budget,
        "--data-parallel-size", str(config.data_parallel_size),
    ]  # fmt: skip


def start_native_server(config: NativeServerConfig) -> NativeServer:
    """Start and wait for `/health`; the caller must `stop_native_server`."""
    http_port, kv_port, replay_port = config.ports or (
        _free_ports(1)[0], *_free_runs(2, config.data_parallel_size))
    log_dir = config.cache_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"native-server-{os.getpid()}-{http_port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env.pop("VLLM_API_KEY", None)
    if config.api_key:
        env["VLLM_API_KEY"] = config.api_key  # read by --api-key's default, kept off argv
    if config.cache_control_token:
        env["FAK_CACHE_CONTROL_TOKEN"] = config.cache_control_token
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            bound_to_this_process(server_command(config, http_port, kv_port, replay_port)),
            stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT,
            start_new_session=True)
    server = NativeServer(
        base_url=f"http://127.0.0.1:{http_port}", model=config.served_model_name,
        kv_endpoint=f"tcp://127.0.0.1:{kv_port}", kv_endpoint_mode="connect",
        kv_topic=config.kv_topic, replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        block_size=config.block_size, num_blocks=config.num_blocks, log_path=log_path,
        process=proc, cache_control_token=config.cache_control_token, config=config)
    try:
        _wait_healthy(server, config.startup_timeout_s)
    except BaseException:
        stop_native_server(server)
        raise
    server.startup_s = time.monotonic() - started
    return server


def stop_native_server(server: NativeServer, grace_s: float = 20.0) -> None:
    """SIGTERM (the server closes its engine and sockets), SIGKILL after `grace_s`."""
    if server.is_alive():
        server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.process.wait()


def _wait_healthy(server: NativeServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not server.is_alive():
                raise NativeServerError(f"native server exited with "
                                        f"{server.process.returncode}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return
            time.sleep(0.5)
    raise NativeServerError(f"native server not healthy after {timeout_s:.0f} s:\n"
                            f"{server.log_tail()}")


def _free_runs(count: int, width: int) -> list[int]:
    """`count` base ports, each with `width` consecutive free ports (one per DP rank)."""
    bases: list[int] = []
    while len(bases) < count:
        (base,) = _free_ports(1)
        taken = {p for b in bases for p in range(b, b + width)}
        if all(_port_free(p) and p not in taken for p in range(base, base + width)):
            bases.append(base)
    return bases


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
