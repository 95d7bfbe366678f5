"""`fak engine serve --enable-cache-control`: exact-span eviction over HTTP.

Two routes no vLLM has, off by default, behind their own bearer token (the
`FAK_CACHE_CONTROL_TOKEN` environment variable, required when enabled), compared in
constant time:

- `GET /fak/v1/cache/capabilities` → `{"exact_span_evict": true, "int_block_hashes": ...}`;
- `POST /fak/v1/cache/evict_span` `{namespace, span: {text | messages | token_ids}, start}`
  → the engine's own account of the cut (`schemas.cache_control.SpanEviction`), its removed
  blocks named as this server's KV events name them, so a subscriber can match the
  `BlockRemoved` set it receives.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from aiohttp import web

from native_engine.async_engine import AsyncLLMEngine
from native_engine.cache_control import cut_span
from native_engine.serve.openai_api import bad_request, parse_json
from native_engine.serve.openai_serving import OpenAIServing
from schemas.cache_control import SpanSpec
from schemas.engine import EngineError
from schemas.values import is_int

TOKEN_ENV = "FAK_CACHE_CONTROL_TOKEN"


class CacheControlRoutes:
    def __init__(self, engine: AsyncLLMEngine, serving: OpenAIServing, token: str,
                 int_block_hashes: bool) -> None:
        if not token:
            raise ValueError(f"--enable-cache-control needs {TOKEN_ENV} set")
        self.engine, self.serving = engine, serving
        self._digest = hashlib.sha256(token.encode()).digest()
        self.int_block_hashes = int_block_hashes

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/fak/v1/cache/capabilities", self.capabilities)
        app.router.add_post("/fak/v1/cache/evict_span", self.evict_span)

    def _authorised(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(presented, self._digest)

    def _refused(self) -> web.Response:
        return web.json_response(EngineError(401, "invalid or missing cache-control token",
                                             type="Unauthorized").to_json(), status=401)

    async def capabilities(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return self._refused()
        return web.json_response({"exact_span_evict": True,
                                  "int_block_hashes": self.int_block_hashes})

    async def evict_span(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return self._refused()
        try:
            namespace, span, start = self._parse(parse_json(await request.read()))
            tokens = self.serving.span_tokens(span)
            report = await self.engine.call(
                lambda e: cut_span(e, namespace, tokens, start, self.int_block_hashes))
        except ValueError as exc:
            raise bad_request(str(exc), None) from None
        return web.json_response(report.eviction(len(tokens), start).to_json())

    @staticmethod
    def _parse(body: Any) -> tuple[str, SpanSpec, int]:
        if not isinstance(body, dict) or set(body) - {"namespace", "span", "start"}:
            raise ValueError("the body is {namespace, span, start}")
        namespace, start = body.get("namespace"), body.get("start", 0)
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace must be a non-empty string (a cache salt)")
        if not is_int(start) or start < 0:
            raise ValueError("start must be an int >= 0")
        return namespace, SpanSpec.from_json(body.get("span")), start
