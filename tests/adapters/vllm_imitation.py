"""A loopback aiohttp server that answers like vLLM 0.32.0, from recorded traffic.

Non-streaming generations replay the recorded responses of http.jsonl in recorded order per
(path, prompt or messages, cache_salt); streams replay the recorded chat SSE lines of
http_edge_cases.txt; errors reuse the recorded error bodies. Every request is logged, so tests
can check what the driver really sent.

Unrecorded completions meet a prefix cache like vLLM's (whole prompts keyed by salt and
data-parallel rank, hits in whole blocks, the last token recomputed). Switches make it
answer like a vLLM that isolates worse: another `prefix_caching_hash_algo` in
`vllm:cache_config_info` (or none), no salt validation, or salts accepted but ignored by
the cache; or cut a stream short (`cut_stream_after`), as a crashing engine would.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.adapters.vllm_vectors import INT_RUN, http_records

EDGE = (INT_RUN / "http_edge_cases.txt").read_text().splitlines()
FINGERPRINT = next(
    r["response"]["system_fingerprint"] for r in http_records(INT_RUN) if "request" in r
)


def _repaired(line: str) -> str:
    """The recording cut the usage chunk inside `system_fingerprint`; restore the recorded one."""
    if line == "data: [DONE]":
        return line
    try:
        json.loads(line[len("data: ") :])
    except ValueError:
        cut = line.rindex('"system_fingerprint"')
        return line[:cut] + json.dumps({"system_fingerprint": FINGERPRINT})[1:]
    return line


SSE_LINES = [_repaired(line[len("SSE ") :]) for line in EDGE if line.startswith("SSE ")]
BAD_JSON_BODY = next(line for line in EDGE if line.startswith("badjson 400 ")).split(" ", 2)[2]
BAD_MODEL_BODY = next(line for line in EDGE if line.startswith("badmodel 404 ")).split(" ", 2)[2]
SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
SALT_RULE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
)
MODEL = "smollm2"
RECORDED_HASH_ALGO = 'prefix_caching_hash_algo="sha256_cbor"'
RECORDED_BLOCK_SIZE = 128


def request_key(path: str, body: dict[str, Any]) -> str:
    return json.dumps([path, body.get("prompt"), body.get("messages"), body.get("cache_salt")])


@dataclass
class Imitation:
    """Behaviour switches and the log of what was received."""

    flat_errors: bool = False
    dev_mode: bool = True
    reset_body: str = '{"success":true}'
    stream_delay_s: float = 0.0
    head_delay_s: float = 0.0
    prompt_details: bool = True
    hash_algo: str | None = "sha256_cbor"
    validates_salts: bool = True
    honours_salts: bool = True
    version: str = "0.32.0"
    cut_stream_after: int | None = None  # a stream's connection is closed after this many
    cached: set[tuple[str | None, str | None, str]] = field(default_factory=set)
    die_after_events: int | None = None  # a stream's connection is reset after this many
    end_delay_s: float = 0.0  # between a stream's [DONE] and the end of its body
    first_event_delay_s: float = 0.0  # between a stream's head and its first event
    metrics_edit: Callable[[str], str] | None = None  # applied to the recorded /metrics
    generation_error: int | None = None  # every generation request answered this status
    received: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # each request's client address
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    recorded: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        for record in http_records(INT_RUN):
            if "request" in record:
                self.recorded[request_key(record["path"], record["request"])].append(record)

    def error(self, status: int, message: str, type_: str, param: str | None) -> web.Response:
        fields = {"message": message, "type": type_, "param": param, "code": status}
        body = {"object": "error", **fields} if self.flat_errors else {"error": fields}
        return web.json_response(body, status=status)


    def metrics_text(self) -> str:
        text = (INT_RUN / "metrics_after.prom").read_text()
        assert RECORDED_HASH_ALGO in text
        if self.metrics_edit is not None:
            text = self.metrics_edit(text)
        if self.hash_algo is None:
            return "\n".join(line for line in text.splitlines()
                             if not line.startswith("vllm:cache_config_info"))
        return text.replace(RECORDED_HASH_ALGO, f'prefix_caching_hash_algo="{self.hash_algo}"')

    def cached_tokens(self, body: dict[str, Any], rank: str | None = None) -> int:
        """Whole blocks of an earlier identical prompt in the same (honoured) salt, on the
        same data-parallel rank (each rank has its own cache, as on vLLM)."""
        prompt = str(body.get("prompt", ""))
        key = (rank, body.get("cache_salt") if self.honours_salts else None, prompt)
        hit = key in self.cached
        self.cached.add(key)
        tokens = len(prompt.split())
        return (tokens - 1) // RECORDED_BLOCK_SIZE * RECORDED_BLOCK_SIZE if hit else 0


def unrecorded_completion(body: dict[str, Any], prompt_details: bool,
                          cached: int = 0) -> dict[str, Any]:
    """A request the run did not record gets the recorded shape with the cache's usage."""
    first = next(r for r in http_records(INT_RUN) if r["path"] == "/v1/completions")
    response = json.loads(json.dumps(first["response"]))
    prompt_tokens = len(str(body.get("prompt", "")).split())
    details = {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
    response["usage"] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 1,
        "completion_tokens": 1,
        "prompt_tokens_details": details if prompt_details else None,
        "completion_tokens_details": None,
    }
    return response


def build_app(state: Imitation) -> web.Application:
    async def log_request(request: web.Request) -> Any:
        raw = await request.read()
        state.peers.append(request.transport.get_extra_info("peername")
                           if request.transport else None)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        state.received.append(
            (
                request.method,
                request.path_qs,
                {k.lower(): v for k, v in request.headers.items()},
                body,
            )
        )
        return body

    async def generation(request: web.Request) -> web.StreamResponse:
        body = await log_request(request)
        if state.head_delay_s:
            await asyncio.sleep(state.head_delay_s)
        if state.generation_error is not None:
            return state.error(state.generation_error, "imitated failure", "EngineError", None)
        if not isinstance(body, dict):
            return web.Response(status=400, text=BAD_JSON_BODY, content_type="application/json")
        salt = body.get("cache_salt")
        if state.validates_salts and salt is not None and (
                not isinstance(salt, str) or not salt.strip()):
            return state.error(400, SALT_EMPTY, "BadRequestError", "cache_salt")
        if state.validates_salts and isinstance(salt, str) and (
                len(salt) > 128 or any(c in salt for c in "@/\\\0")):
            return state.error(400, SALT_RULE, "BadRequestError", "cache_salt")
        if body.get("model") != MODEL:
            return web.Response(status=404, text=BAD_MODEL_BODY, content_type="application/json")
        if body.get("stream"):
            return await stream(request, body)
        queue = state.recorded.get(request_key(request.path, body))
        if queue:
            return web.json_response(queue.pop(0)["response"])
        if request.path == "/v1/completions":
            rank = request.headers.get("X-data-parallel-rank")
            return web.json_response(unrecorded_completion(body, state.prompt_details,
                                                           state.cached_tokens(body, rank)))
        return state.error(500, "no recorded response", "InternalServerError", None)

    async def stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        await asyncio.sleep(state.first_event_delay_s)
        try:
            for sent, line in enumerate(line for line in SSE_LINES
                                        if include_usage or '"choices":[]' not in line):
                if sent == state.cut_stream_after:  # the engine closes mid-stream (FIN)
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if sent == state.die_after_events:  # the engine dies: reset mid-body (RST)
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                await response.write(f"{line}\n\n".encode())
                await asyncio.sleep(state.stream_delay_s)
        except (ConnectionResetError, asyncio.CancelledError):
            state.disconnected.set()
            raise
        await asyncio.sleep(state.end_delay_s)
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        await log_request(request)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "created": 1796023880,
                        "owned_by": "vllm",
                        "root": "/models/smollm2",
                        "parent": None,
                        "max_model_len": 2048,
                        "permission": [],
                    }
                ],
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        await log_request(request)
        return web.Response(text=state.metrics_text(), content_type="text/plain")

    async def simple(request: web.Request) -> web.Response:
        await log_request(request)
        if request.path == "/version":
            return web.json_response({"version": state.version})
        return web.Response(status=200)

    async def reset(request: web.Request) -> web.Response:
        await log_request(request)
        if not state.dev_mode:
            return web.json_response({"detail": "Not Found"}, status=404)
        if request.method != "POST":
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        return web.Response(text=state.reset_body, content_type="application/json")

    async def anything_else(request: web.Request) -> web.Response:
        await log_request(request)
        return web.json_response({"detail": "Not Found"}, status=404)

    app = web.Application()
    app.router.add_post("/v1/completions", generation)
    app.router.add_post("/v1/chat/completions", generation)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", simple)
    app.router.add_get("/version", simple)
    app.router.add_route("*", "/reset_prefix_cache", reset)
    app.router.add_route("*", "/{tail:.*}", anything_else)
    return app


async def start_imitation(state: Imitation, port: int = 0) -> tuple[web.AppRunner, str]:
    return await serve_app(build_app(state), port)


async def serve_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """`app` on loopback (port 0: any free one); its runner (to clean up) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
