"""`fak serve`: build the governor from a config (or a dev setup) and run it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from adapters.driver import EngineDriver
from governor.audit.log import AuditLog, AuditLogConfig, AuditLogError, load_or_create_signing_key
from governor.auth import sha256_hex
from governor.config import (
    ConfigError,
    EngineSection,
    GovernorConfig,
    ServerConfig,
    TenantConfig,
    UpstreamSection,
    load_config,
    parse_config,
)
from governor.http.server import GovernorServer
from governor.secrets import StartupRefused, TenantEpochs, load_salt_key
from governor.state import Governor
from governor.workers import WorkerSlot, serve_workers
from policies.salts import SaltKey, SaltKeyError, kv_namespace_key

log = logging.getLogger("fak.serve")
SHUTDOWN_WAIT_S = 10.0  # for the audit's last writes when the state database is away
WORKER_STOP_GRACE_S = 15.0  # a worker's stop beyond its drain and the audit's wait


def dev_config(data_dir: Path) -> tuple[GovernorConfig, str, str]:
    """A working single-tenant setup on the embedded model, with fresh one-time secrets.

    KV tiers stay off here: with a 1 GiB host tier the dev engine started 5 s slower (the
    restore calibration) and served no faster, since one user never fills its 2048-block
    pool (`bench/kv_tiers.py --dev-setup`); a disk tier would keep prompt tokens on disk."""
    api_key = "fak-dev-" + secrets.token_urlsafe(24)
    admin_token = "fak-admin-" + secrets.token_urlsafe(24)
    config = parse_config({"server": {"data_dir": str(data_dir)}, "engine": {"kind": "native"}})
    tenant = TenantConfig(id="dev", api_key_sha256=(sha256_hex(api_key),),
                          tenant_class="interactive")
    server = replace(config.server, admin_token_sha256=sha256_hex(admin_token))
    return replace(config, server=server, tenants=(tenant,)), api_key, admin_token


def build_driver(config: GovernorConfig, salt_key: SaltKey) -> EngineDriver:
    if config.engine.kind == "native":
        from adapters.native import NativeDriver, NativeDriverConfig

        shares = tuple((t.id, t.cache_share) for t in config.tenants
                       if t.cache_share is not None)
        return NativeDriver(NativeDriverConfig.from_section(config.engine, shares))
    if any(t.cache_share is not None for t in config.tenants):
        raise ConfigError("[[tenants]] cache_share reserves native-engine KV blocks; a ridden "
                          "engine offers no capacity isolation (use admission limits and "
                          "rate limits there)")
    if config.engine.upstreams:
        from governor.fleet import build_fleet_driver

        return build_fleet_driver(config.engine, kv_namespace_key(salt_key))
    return build_vllm_driver(config.engine, kv_namespace_key(salt_key))


def build_vllm_driver(section: EngineSection, namespace_key: bytes | None = None
                      ) -> EngineDriver:
    """The single-upstream form: one upstream built like a fleet's (governor.fleet), its
    KV index naming namespaces by `namespace_key` digests."""
    from governor.fleet import upstream_driver

    assert section.base_url is not None  # the config schema requires it for kind = "vllm"
    upstream = UpstreamSection(name="default", base_url=section.base_url,
                               kv_events=section.kv_events, kv_replay=section.kv_replay,
                               metrics_url=section.metrics_url, declare=section.declare)
    return upstream_driver(upstream, section, namespace_key, fak_control_client(section))


def fak_control_client(section: EngineSection) -> Any:
    """The cache-control client of `fak engine serve`, when its token is configured."""
    from adapters.vllm.fak_control import FakCacheControlClient, FakControlConfig

    if section.cache_control_token_env is None:
        return None
    token = os.environ.get(section.cache_control_token_env, "")
    if not token:
        raise StartupRefused(f"[engine] cache_control_token_env names "
                             f"${section.cache_control_token_env}, which is not set")
    assert section.base_url is not None
    return FakCacheControlClient(FakControlConfig(section.base_url, token),
                                 lambda call: log.warning("cache-control call: %s", call))


def governor_salt_key(config: GovernorConfig, create_key: bool) -> SaltKey:
    """The salt key in data_dir (created only when asked); refuses start-up otherwise."""
    data_dir = config.server.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        return SaltKey(load_salt_key(data_dir, create=create_key))
    except SaltKeyError as exc:
        raise StartupRefused(str(exc)) from exc


def build_governor(config: GovernorConfig, driver: EngineDriver, create_key: bool,
                   key: SaltKey | None = None) -> Governor:
    """The governor over `driver`; `key`: the salt key already loaded for the driver (else
    read from data_dir here)."""
    if key is None:
        key = governor_salt_key(config, create_key)
    if config.state.backend == "postgres":
        from governor.store.backend import open_shared_state

        shared = open_shared_state(config, audit_log_config(config), key)
        gov = Governor(config, driver, key, shared.epochs, shared.audit)
        gov.quarantine_store = shared.records
        return gov
    audit = AuditLog.open(audit_log_config(config))
    return Governor(config, driver, key, TenantEpochs(config.server.data_dir, audit.epochs_at_open),
                    audit)


def audit_log_config(config: GovernorConfig) -> AuditLogConfig:
    section = config.audit
    return AuditLogConfig(config.server.data_dir,
                          checkpoint_every_records=section.checkpoint_every_records,
                          checkpoint_every_seconds=section.checkpoint_every_seconds,
                          signing_key_path=section.signing_key_path,
                          anchor_dir=section.anchor_dir, min_free_bytes=section.min_free_bytes)


async def start_driver(driver: EngineDriver) -> None:
    """Start the engine driver; an upstream that fails its probes refuses start-up in one
    line (SEC-16)."""
    from adapters.vllm.capabilities import CapabilityRefusedError

    try:
        await driver.start()
    except CapabilityRefusedError as exc:
        await driver.close()
        raise StartupRefused(f"upstream refused: {exc}") from None


# The young generation's size, in net allocations of tracked objects (CPython's default is
# 700). A request leaves no reference cycles (tests/governor/test_reference_cycles.py), so
# what fills the young generation is the requests in flight, and each collection walks
# them: at 64 in flight, 700 meant 1,056 young collections in 5 s of line rate (with the
# middle ones 5.5% of the CPU, pauses to 1.5 ms); 7,000 meant one (issue 19).
YOUNG_COLLECTION_ALLOCATIONS = 7000


def settle_collector() -> None:
    """Once serving: what was built so far lives as long as the process, so it leaves the
    collector's view (a full collection under load walks only what requests allocate), and
    young collections run a tenth as often (issue 19)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, middle, old)


async def run_governor(gov: Governor, server: ServerConfig,
                       worker: WorkerSlot | None = None) -> None:
    """Serve until SIGINT/SIGTERM; as one of `fak serve --workers N` (governor.workers) on
    the shared port, telling the parent once serving and stopping when the parent is gone."""
    await start_driver(gov.driver)
    listeners = GovernorServer(gov)
    try:
        await listeners.start(server.host, server.port, server.metrics_host,
                              server.metrics_listen_port, reuse_port=worker is not None)
    except StartupRefused:  # a port in use: what was opened is closed, the audit log too
        await gov.driver.close()
        await close_audit(gov)
        raise
    settle_collector()
    name = "" if worker is None else f"worker {worker.index} (pid {os.getpid()}) "
    print(f"fak: {name}serving on {listeners.url} (metrics on {listeners.metrics_url})",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    checkpoints = asyncio.create_task(checkpoint_loop(gov))
    orphaned = None
    if worker is not None:
        worker.ready.put(worker.index)
        orphaned = asyncio.create_task(stop_when_orphaned(worker.parent_pid, stop))
    try:
        await stop.wait()
    finally:
        gov.draining = True
        await drain(gov, server.drain_timeout_s)
        checkpoints.cancel()
        if orphaned is not None:
            orphaned.cancel()
        await listeners.stop()
        await gov.driver.close()
        await close_audit(gov)


async def stop_when_orphaned(parent_pid: int, stop: asyncio.Event, every_s: float = 1.0
                             ) -> None:
    """A worker whose supervisor died (even by SIGKILL) is re-parented: it stops."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(every_s)
    log.error("fak serve's supervisor (pid %d) is gone; this worker stops", parent_pid)
    stop.set()


async def checkpoint_loop(gov: Governor, every_s: float = 1.0) -> None:
    """Every `every_s`: write the client-event summaries due, sign a checkpoint when the
    record or time threshold is reached, retry a failed anchor export. An error is logged
    (once per distinct message, then every minute) and retried on the next tick: the loop
    only ends when cancelled."""
    last_message, last_logged = "", 0.0
    while True:
        await asyncio.sleep(every_s)
        try:
            await gov.flush_audit_summaries()
            await gov.audit.maintain_async()
        except Exception as exc:
            now = time.monotonic()
            if str(exc) != last_message or now - last_logged >= 60:
                log.error("audit checkpoint loop: %s (retrying every %.1f s)", exc, every_s)
                last_message, last_logged = str(exc), now
        else:
            if last_message:
                log.warning("audit checkpoint loop recovered")
                last_message = ""


async def close_audit(gov: Governor) -> None:
    """Write every pending summary, close the log (its final checkpoint), then leave the
    replica registry (postgres)."""
    try:
        await asyncio.wait_for(gov.flush_audit_summaries(force=True), SHUTDOWN_WAIT_S)
    except Exception as exc:
        log.error("audit summaries not written at shutdown: %s", exc)
    await asyncio.to_thread(gov.audit.close)
    await asyncio.to_thread(gov.epochs.close)
    if gov.quarantine_store is not None:
        gov.quarantine_store.close()


async def drain(gov: Governor, deadline_s: float) -> None:
    """Let in-flight streams finish, up to the deadline."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline_s):
            while gov.admission.in_flight:
                await asyncio.sleep(0.05)


def cmd_serve(config_path: str | None, host: str | None, port: int | None,
              data_dir: str | None, init_key: bool = False,
              metrics_port: int | None = None, workers: int | None = None) -> int:
    """With a config the salt key must exist unless `init_key`; the dev setup makes one.
    `workers` (None: the config's) > 1 runs that many governors on the port
    (governor.workers)."""
    if config_path:
        config, create_key, banner = load_config(Path(config_path)), init_key, None
    else:
        config, api_key, admin_token = dev_config(Path(data_dir or "./fak-data"))
        create_key = True
        banner = (f"fak dev setup: tenant 'dev' API key: {api_key}\n"
                  f"fak dev setup: admin token: {admin_token}")
    server = config.server
    if host is not None:
        server = replace(server, host=host)
    if port is not None:
        server = replace(server, port=port)
    if metrics_port is not None:
        server = replace(server, metrics_port=metrics_port)
    if data_dir and config_path:
        server = replace(server, data_dir=Path(data_dir))
    if workers is not None:
        if workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {workers}")
        server = replace(server, workers=workers)
    config = replace(config, server=server)
    key = governor_salt_key(config, create_key)
    if server.workers > 1:
        try:  # made once, here: workers starting together would race to create it
            load_or_create_signing_key(audit_log_config(config).key_path)
        except AuditLogError as exc:
            raise StartupRefused(str(exc)) from None
        return serve_workers(config, worker_main,
                             server.drain_timeout_s + SHUTDOWN_WAIT_S + WORKER_STOP_GRACE_S)
    driver = build_driver(config, key)
    gov = build_governor(config, driver, create_key, key)
    if banner:
        print(banner, flush=True)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(run_governor(gov, server))
    return 0


def worker_main(config: GovernorConfig, slot: WorkerSlot) -> None:
    """One process of `fak serve --workers N` (spawned by governor.workers): the governor of
    its share of `config`; a start-up refusal is printed in one line, exit code 2."""
    try:
        key = governor_salt_key(config, create_key=False)  # the parent made it if asked
        driver = build_driver(config, key)
        gov = build_governor(config, driver, False, key)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(run_governor(gov, config.server, slot))
    except (ConfigError, StartupRefused) as exc:
        print(f"fak: worker {slot.index}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:  # a Ctrl-C reaches the whole process group; the parent stops us
        pass


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (its transports and scheduling cost the
    governor's hot path less: issue 19, bench/line_rate.py), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
