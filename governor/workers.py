"""`fak serve --workers N`: N governor processes on one tenant port, supervised.

Each worker is a whole governor (its own engine session, admission, metrics) listening on
the same port with SO_REUSEPORT, so the kernel spreads connections over them. What must be
one thing across workers is:

- **state** — epochs, quarantine records, the audit log: through the postgres backend, each
  worker a replica of its own (`<replica_id>-w<i>`), exactly as separate replicas share it
  (docs/operations.md §9). The file backend is one process's, so N > 1 refuses it;
- **admission caps** — split, not shared: worker i admits with its share of every cap
  (policies.worker_shares), the shares summing to the configured totals; so is
  `max_connections_per_peer`, so one address holds no more connections than one process
  would let it;
- **metrics** — per worker, each on its own private listener (`metrics_port + i`; 0: any
  free port, each worker prints where). The tenant-port `/metrics` would answer for
  whichever worker holds the connection, so N > 1 refuses `metrics_token_sha256`.

The parent only supervises: it reserves the port (bound with SO_REUSEPORT, never listening,
so a port 0 becomes one port for all), starts the workers (spawned interpreters, not
forks of a process holding sockets and threads) and waits. A worker that exits before it
serves stops the whole server (exit 1: a start-up refusal is every worker's); one that dies
while serving is restarted, at most `MAX_RESTARTS` times per `RESTART_WINDOW_S`, after
which the server stops, loudly. SIGTERM/SIGINT stop every worker (each drains as one
governor does) and then the parent. A worker whose parent is gone stops itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from governor.config import ConfigError, GovernorConfig
from policies.worker_shares import integer_share, tenant_share, unsplittable

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
REPLICA_ID_MAX = 63  # [state] replica_id's pattern


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """What a worker process knows of its place: its index, whom to tell it is serving, and
    the parent whose exit stops it."""

    index: int
    ready: Any  # a multiprocessing queue: the worker puts its index once it serves
    parent_pid: int


def check_workers(config: GovernorConfig) -> None:
    """Refuse, in one line, what N workers cannot do as one governor would."""
    workers = config.server.workers
    if workers == 1:
        return
    if config.engine.kind == "native":
        raise ConfigError('[server] workers > 1: the native engine runs inside the governor '
                          'process (one engine per worker is not one engine); use 1 worker')
    if config.state.backend != "postgres":
        raise ConfigError('[server] workers > 1 needs [state] backend = "postgres": the '
                          'workers share epochs, quarantine records and the audit log '
                          'through it (the file backend is one process\'s)')
    if config.server.metrics_token_sha256 is not None:
        raise ConfigError("[server] workers > 1: metrics_token_sha256 would serve one "
                          "worker's /metrics on the tenant port; scrape each worker's "
                          "metrics listener instead")
    server = config.server
    for name in ("max_engine_concurrency", "max_queued", "max_connections_per_peer"):
        if getattr(server, name) < workers:
            raise ConfigError(f"[server] {name} = {getattr(server, name)} cannot give each "
                              f"of {workers} workers at least 1")
    for tenant in config.tenants:
        reason = unsplittable(tenant, workers)
        if reason is not None:
            raise ConfigError(f"[server] workers = {workers}: {reason}")


def worker_config(config: GovernorConfig, index: int, port: int, replica_base: str
                  ) -> GovernorConfig:
    """Worker `index`'s governor: the reserved port, its metrics port, its replica id and
    its share of every admission cap and of the per-peer connection cap."""
    server, workers = config.server, config.server.workers
    metrics = server.metrics_listen_port
    server = replace(server, port=port, metrics_port=metrics + index if metrics else 0,
                     max_engine_concurrency=integer_share(server.max_engine_concurrency,
                                                          workers, index),
                     max_queued=integer_share(server.max_queued, workers, index),
                     max_connections_per_peer=integer_share(server.max_connections_per_peer,
                                                            workers, index))
    suffix = f"-w{index}"
    state = replace(config.state,
                    replica_id=replica_base[: REPLICA_ID_MAX - len(suffix)] + suffix)
    tenants = tuple(tenant_share(t, workers, index) for t in config.tenants)
    return replace(config, server=server, state=state, tenants=tenants)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening: it holds the port
    (a 0 picks one) for the workers, who bind it the same way and listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


Target = Callable[[GovernorConfig, WorkerSlot], None]


def serve_workers(config: GovernorConfig, target: Target, stop_wait_s: float) -> int:
    """Run `config.server.workers` processes of `target` (a module-level function: it is
    pickled by name) until a signal (0) or a failure (1); each gets `stop_wait_s` to stop
    after SIGTERM. The salt key must already be in data_dir (the caller created it if
    asked)."""
    from governor.store.backend import default_replica_id

    check_workers(config)
    reserved = reserve_port(config.server.host, config.server.port)
    try:
        supervisor = Supervisor(config, reserved.getsockname()[1],
                                config.state.replica_id or default_replica_id(), target,
                                stop_wait_s)
        return supervisor.run()
    finally:
        reserved.close()


class Supervisor:
    """The parent's loop. Invariant: one live process per index, except between a death
    and its restart within one pass of `run`."""

    def __init__(self, config: GovernorConfig, port: int, replica_base: str, target: Target,
                 stop_wait_s: float) -> None:
        self.config, self.port, self.replica_base = config, port, replica_base
        self.target, self.stop_wait_s = target, stop_wait_s
        self.ctx = multiprocessing.get_context("spawn")
        self.ready = self.ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.serving: set[int] = set()
        self.restarts: list[float] = []
        self.stopping = False

    def _start(self, index: int) -> None:
        slot = WorkerSlot(index, self.ready, os.getpid())
        proc = self.ctx.Process(target=self.target, name=f"fak-worker-{index}", args=(
            worker_config(self.config, index, self.port, self.replica_base), slot))
        proc.start()
        self.procs[index] = proc
        self.serving.discard(index)

    def _stop_requested(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop_requested)
        host = self.config.server.host
        print(f"fak: {self.config.server.workers} workers on http://{host}:{self.port}",
              flush=True)
        for index in range(self.config.server.workers):
            self._start(index)
        status = 0
        try:
            while not self.stopping and status == 0:
                multiprocessing.connection.wait(
                    [p.sentinel for p in self.procs.values()], timeout=0.5)
                self._collect_ready()
                status = self._reap()
        finally:
            self._stop_all()
        return status

    def _collect_ready(self) -> None:
        while True:
            try:
                self.serving.add(self.ready.get_nowait())
            except (queue.Empty, EOFError, OSError):  # nothing more (or a worker gone mid-put)
                return

    def _reap(self) -> int:
        """Restart the workers that died while serving; 1 when the server must stop."""
        for index, proc in list(self.procs.items()):
            if proc.is_alive() or self.stopping:
                continue
            self._collect_ready()
            if index not in self.serving:
                _say(f"worker {index} exited with code {proc.exitcode} before serving; "
                     "stopping every worker")
                return 1
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                _say(f"worker {index} exited with code {proc.exitcode}: more than "
                     f"{MAX_RESTARTS} restarts in {RESTART_WINDOW_S:g} s; stopping every "
                     "worker")
                return 1
            _say(f"worker {index} (pid {proc.pid}) exited with code {proc.exitcode}; "
                 "restarting it")
            self._start(index)
        return 0

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + self.stop_wait_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                _say(f"worker pid {proc.pid} did not stop in time; killing it")
                proc.kill()
                proc.join()


def _say(message: str) -> None:
    print(f"fak: {message}", file=sys.stderr, flush=True)
