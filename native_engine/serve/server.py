"""`fak engine serve`: the native engine behind vLLM 0.32's three public surfaces.

1. OpenAI HTTP (aiohttp): `POST /v1/completions`, `POST /v1/chat/completions` (SSE with
   `stream`), `GET /v1/models`, `/health`, `/version`; answers shaped as vLLM's
   (native_engine.serve.openai_api), errors as `{"error": {message, type, param, code}}`.
2. KV-cache events: ZeroMQ PUB (+ ROUTER replay) as `--kv-events-config` says, one batch per
   engine step that changed the prefix cache (native_engine.kv_events).
3. `GET /metrics` with vLLM's names (native_engine.serve.metrics), plus the KV tiers'.

`--kv-offloading-size GiB` (host RAM), `--kv-disk-dir DIR` and `--kv-disk-size GiB` add KV
tiers below the device pool (native_engine.kvcache.tiers); their restore rates are measured
at start-up and logged.

`--dev-mode` (or VLLM_SERVER_DEV_MODE=1, as vLLM) mounts `POST /reset_prefix_cache` and
`GET /kv_event_sources`. `--data-parallel-size N` runs N engines in this process with vLLM's
port offsets and `X-data-parallel-rank` header (native_engine.serve.ranks). `--api-key` (or
VLLM_API_KEY) guards every `/v1` route as vLLM does: `Authorization: Bearer <key>`, else
401 `{"error": "Unauthorized"}`. Flags mirror vLLM's where they overlap. Run it as
`python -m native_engine.serve.server [flags]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from native_engine.async_engine import AsyncLLMEngine, EngineDeadError, SupervisorConfig
from native_engine.config import EngineConfig, SchedulingPolicy
from native_engine.engine import LLMEngine
from native_engine.kvcache.events import EventPublisher
from native_engine.serve.control_routes import TOKEN_ENV, CacheControlRoutes
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.kv_publisher import PublisherSocketError
from native_engine.serve.metrics import ServerMetrics
from native_engine.serve.openai_api import parse_json, validate_body
from native_engine.serve.openai_serving import OpenAIServing
from native_engine.serve.ranks import (
    RANK_HEADER,
    MergedRegistry,
    RankEngine,
    RankSpec,
    build_ranks,
    kv_sources,
    pick_rank,
)
from schemas.engine import EngineError, StreamChunk
from schemas.openai import Route

log = logging.getLogger("fak.engine.serve")

EMBEDDED_MODEL_NAME = "smollm2"
EMBEDDED_MODEL_ROOT = "embedded:SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 32 << 20


class ListenRefused(RuntimeError):
    """The HTTP port could not be bound (in use, not permitted)."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `fak engine serve` is started with; validated once, here."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    # vLLM's API-server default on a CPU: a 1,000-token prompt is prefilled in one step
    max_num_batched_tokens: int = 2048
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_prompt_tokens_details: bool = False
    attention_backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    dev_mode: bool = False
    cache_control_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    data_parallel_size: int = 1
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    kv_offloading_size: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if isinstance(self.data_parallel_size, bool) or not isinstance(
                self.data_parallel_size, int) or not 1 <= self.data_parallel_size <= 64:
            raise ValueError(f"data_parallel_size must be an int in [1, 64], got "
                             f"{self.data_parallel_size!r}")
        if self.data_parallel_size > 1 and self.kv_disk_dir is not None:
            raise ValueError("--kv-disk-dir is one rank's directory; it cannot be combined "
                             "with --data-parallel-size > 1")
        if self.data_parallel_size > 1 and self.cache_control_token is not None:
            raise ValueError("--enable-cache-control serves one engine; it cannot be combined "
                             "with --data-parallel-size > 1")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty")
        self.engine_config().runner_config()  # the engine's and runner's own rules

    @property
    def model_name(self) -> str:
        """vLLM's rule: the served name defaults to the --model value."""
        return self.served_model_name or self.model or EMBEDDED_MODEL_NAME

    @property
    def model_root(self) -> str:
        return self.model or EMBEDDED_MODEL_ROOT

    def rank_spec(self) -> RankSpec:
        return RankSpec(self.engine_config(), self.kv_events, self.supervisor, self.model_name,
                        self.enable_prompt_tokens_details, self.scheduling_policy == "priority")

    def engine_config(self) -> EngineConfig:
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return EngineConfig(
            block_size=self.block_size, num_blocks=self.num_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            scheduling_policy=self.scheduling_policy, max_model_len=self.max_model_len,
            model=self.model, dtype=self.dtype, attention_backend=self.attention_backend,
            device=device, kv_offloading_size=self.kv_offloading_size,
            kv_disk_dir=self.kv_disk_dir, kv_disk_size=self.kv_disk_size)


def error_response(exc: EngineError) -> web.Response:
    return web.json_response(exc.to_json(), status=exc.status)


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


@web.middleware
async def fastapi_shaped_errors(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
    """404/405 as FastAPI words them (`{"detail": ...}`); anything unexpected as a 500
    error JSON rather than aiohttp's text page."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status in (404, 405):
            return web.json_response({"detail": exc.reason}, status=exc.status,
                                     headers={k: v for k, v in exc.headers.items()
                                              if k.lower() == "allow"})
        raise
    except EngineError as exc:
        return error_response(exc)
    except EngineDeadError as exc:
        return error_response(EngineError(503, f"the native engine is not running: {exc}",
                                          type="ServiceUnavailableError"))
    except Exception as exc:  # a bug must still answer in the API's error shape
        log.exception("unhandled error on %s", request.path)
        return error_response(EngineError(500, f"internal error: {exc!r}"))


def api_key_guard(api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """vLLM's `--api-key`: `/v1` routes need `Authorization: Bearer <key>` (compared by
    digest in constant time); everything else (health, version, metrics) stays open."""
    expected = hashlib.sha256(api_key.encode()).digest()

    @web.middleware
    async def guard(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
            if scheme != "Bearer" or not hmac.compare_digest(presented, expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return guard


class EngineServer:
    """The aiohttp handlers over the running ranks (one unless data parallel)."""

    def __init__(self, config: ServerConfig, ranks: tuple[RankEngine, ...]) -> None:
        self.config = config
        self.ranks = ranks
        self._metrics = MergedRegistry(r.metrics.registry for r in ranks)

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.ranks[0].engine

    @property
    def serving(self) -> OpenAIServing:
        return self.ranks[0].serving

    @property
    def metrics(self) -> ServerMetrics:
        return self.ranks[0].metrics

    def app(self) -> web.Application:
        guards = [api_key_guard(self.config.api_key)] if self.config.api_key else []
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[fastapi_shaped_errors, *guards])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.scrape)
        if self.config.cache_control_token is not None:
            log.warning("cache-control routes are enabled (exact-span eviction over HTTP)")
            CacheControlRoutes(self.engine, self.serving, self.config.cache_control_token,
                               self.config.kv_events.int_block_hashes).add_to(app)
        if self.config.dev_mode:
            log.warning("SECURITY WARNING: Development endpoints are enabled! This should NOT "
                        "be used in production!")
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
            app.router.add_get("/kv_event_sources", self.kv_event_sources)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, route: Route) -> web.StreamResponse:
        # The engine id stays unique even when clients repeat an X-Request-Id.
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            rank = pick_rank(self.ranks, request.headers.get(RANK_HEADER))
        except EngineError as exc:
            return error_response(exc)
        with rank.serving_one():
            try:
                parsed = validate_body(route, parse_json(await request.read()))
                prepared = await rank.serving.prepare_off_loop(route, parsed, None, None)
                events = rank.serving.generate(prepared,
                                               f"{request_id}-{uuid.uuid4().hex[:8]}")
                first = await anext(events)
            except EngineError as exc:
                return error_response(exc)
            async with contextlib.aclosing(events):
                if not prepared.stream:
                    return web.Response(body=_json_bytes(first.data),
                                        content_type="application/json")
                return await self._stream(request, first, events)

    async def _stream(self, request: web.Request, first: StreamChunk,
                      events: AsyncGenerator[StreamChunk, None]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        item = first
        try:
            while True:
                data = b"[DONE]" if item.done else _json_bytes(item.data)
                await response.write(b"data: " + data + b"\n\n")
                if item.done:
                    break
                try:
                    item = await anext(events)
                except EngineError as exc:  # mid-stream: vLLM sends the error as an event
                    await response.write(b"data: " + _json_bytes(exc.to_json()) + b"\n\n")
                    item = StreamChunk(None, done=True)
            await response.write_eof()
        except ConnectionResetError:  # the client left; closing `events` aborts the request
            log.info("client disconnected from %s", request.path)
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(self.serving.models(self.config.model_root))

    async def health(self, request: web.Request) -> web.Response:
        """200 (empty, as vLLM) only while every rank's engine loop runs; else 503 saying
        why (the first rank that is down)."""
        for rank in self.ranks:
            live = rank.engine.liveness()
            if not live.alive:
                return web.json_response({"status": live.state.value, "reason": live.reason,
                                          "restarts": live.restarts, "rank": rank.rank},
                                         status=503)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": fak_version()})

    async def scrape(self, request: web.Request) -> web.Response:
        for rank in self.ranks:
            if rank.engine.is_alive:
                with contextlib.suppress(EngineDeadError):  # it died since: serve what we have
                    rank.metrics.update(await rank.engine.stats())
        return web.Response(body=generate_latest(self._metrics),  # type: ignore[arg-type]
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Every rank's prefix cache (as vLLM resets all DP engines); success only if all."""
        results = [await rank.engine.reset_prefix_cache() for rank in self.ranks]
        return web.json_response({"success": all(results)})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(kv_sources(self.config.kv_events, len(self.ranks)))


def fak_version() -> str:
    try:
        return metadata.version("fak")
    except metadata.PackageNotFoundError:
        return "0.1.0+source"


# -- start-up and the command line --------------------------------------------------------


@dataclass
class RunningServer:
    """A started server: its URL and ranks (engines, publishers); `close()` stops all."""

    config: ServerConfig
    base_url: str
    ranks: tuple[RankEngine, ...]
    runner: web.AppRunner

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.ranks[0].engine

    @property
    def publisher(self) -> EventPublisher:
        return self.ranks[0].publisher

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine.engine

    async def close(self) -> None:
        await self.runner.cleanup()
        for rank in self.ranks:
            await rank.close()


async def build_server(config: ServerConfig) -> EngineServer:
    """Load the model, start every rank's engine loop and KV-event publisher."""
    return EngineServer(config, await build_ranks(config.rank_spec(),
                                                  config.data_parallel_size))


async def start_server(config: ServerConfig) -> RunningServer:
    """Build and bind (port 0 picks a free port); the caller must `close()` it."""
    server = await build_server(config)
    runner = web.AppRunner(server.app(), access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
    except BaseException as exc:
        await runner.cleanup()
        for rank in server.ranks:
            await rank.close()
        if isinstance(exc, OSError):  # the port: in use, not permitted
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ListenRefused(f"cannot listen on {config.host}:{config.port}: {reason}"
                                ) from None
        raise
    host, port = runner.addresses[0][:2]
    return RunningServer(config, f"http://{host}:{port}", server.ranks, runner)


async def serve_forever(config: ServerConfig) -> None:
    running = await start_server(config)
    log.info("fak engine serve: %s on %s (model %s)", config.model_name, running.base_url,
             config.model_root)
    try:
        await asyncio.Event().wait()
    finally:
        await running.close()


def build_parser(prog: str = "fak engine serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve the native engine on vLLM's "
                                "OpenAI HTTP, KV-event and /metrics surfaces.")
    add_serve_arguments(p)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, named as vLLM's where they overlap (for `fak engine serve` too)."""
    d = ServerConfig.__dataclass_fields__
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--model", help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--served-model-name")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--num-gpu-blocks-override", "--num-blocks", dest="num_blocks", type=int,
                   default=d["num_blocks"].default, help="KV pool size in blocks")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=d["max_num_batched_tokens"].default)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--kv-events-config", help="vLLM's KVEventsConfig as JSON")
    p.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dev-mode", action="store_true",
                   help="mount POST /reset_prefix_cache (also VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--data-parallel-size", "-dp", type=int,
                   default=d["data_parallel_size"].default,
                   help="engines in this process, one per rank (vLLM's port offsets and "
                   "X-data-parallel-rank header)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require this bearer token on /v1 routes (default: $VLLM_API_KEY)")
    p.add_argument("--enable-cache-control", action="store_true",
                   help=f"mount fak's exact-span eviction route, behind the bearer token in "
                   f"${TOKEN_ENV} (required)")
    p.add_argument("--kv-offloading-size", type=float, metavar="GiB",
                   help="host-RAM KV tier below the device pool, in GiB (vLLM's flag)")
    p.add_argument("--kv-disk-dir", metavar="DIR", help="disk KV tier directory (survives "
                   "restarts; keep it private: whoever writes it can plant KV)")
    p.add_argument("--kv-disk-size", type=float, metavar="GiB",
                   help="disk KV tier size in GiB (with --kv-disk-dir)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    kv_events = (KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config
                 else KVEventsConfig())
    return ServerConfig(
        host=args.host, port=args.port, model=args.model,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        attention_backend=args.attention_backend, dtype=args.dtype, device=args.device,
        dev_mode=args.dev_mode or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        cache_control_token=_cache_control_token(args.enable_cache_control),
        api_key=args.api_key, data_parallel_size=args.data_parallel_size,
        kv_events=kv_events, kv_offloading_size=args.kv_offloading_size,
        kv_disk_dir=args.kv_disk_dir, kv_disk_size=args.kv_disk_size)


def _cache_control_token(enabled: bool) -> str | None:
    if not enabled:
        return None
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        raise ValueError(f"--enable-cache-control needs ${TOKEN_ENV} (at least 16 characters)")
    return token


def cmd_engine_serve(args: argparse.Namespace) -> int:
    """`fak engine serve`: run until SIGINT/SIGTERM; 2 on a bad configuration or a port
    (HTTP or KV events) it cannot have."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"fak engine serve: {exc}", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    main_task = loop.create_task(serve_forever(config))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        loop.run_until_complete(main_task)
    except asyncio.CancelledError:
        pass
    except (ListenRefused, PublisherSocketError) as exc:
        print(f"fak engine serve: {exc}", file=sys.stderr)
        return 2
    finally:
        loop.close()
    return 0


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m native_engine.serve.server") -> int:
    return cmd_engine_serve(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
