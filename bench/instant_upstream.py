"""A near-instant vLLM-shaped upstream for measuring the governor's own overhead.

Benchmark tool only (docs/reference/benchmarking.md §7: a mock upstream keeps the engine from
dominating); the governor's correctness is tested against real engines. Answers /v1/models,
/metrics, /health and both generation routes, streaming or not, in vLLM 0.32's shapes, at
once. It passes the governor's isolation probes as a vLLM does (SEC-16): `/version`,
`vllm:cache_config_info` with a SHA-256 hash, vLLM's `cache_salt` validation, and
`cached_tokens` for a repeated prompt under the same salt (whole blocks; a bounded memory of
recent prompts). `fak bench overhead --engine` points at it to measure the governor alone
(docs/benchmarks.md); it stays out of the package because serving fake answers is not a
product feature.

    python bench/instant_upstream.py --port 8101 [--chunks 16] [--interval-ms 0] [--prefill-ms 0] \
        [--metrics-file ../shared/vectors/vllm-0.32.0-cpu/metrics_after.prom]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import OrderedDict
from pathlib import Path

from aiohttp import web

MODEL = "smollm2"
BLOCK_SIZE = 16
NUM_BLOCKS = 4096
REMEMBERED_PROMPTS = 4096
CACHE_CONFIG = (f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",enable_prefix_caching="True",'
                f'engine="0",num_gpu_blocks="{NUM_BLOCKS}",'
                'prefix_caching_hash_algo="sha256_cbor"} 1.0\n')
SALT_RULE = ("Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
             "without '@', '/', '\\' or NUL. (parameter=cache_salt)")


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": None,
                                      "multimodal_tokens": None}}


def _bad_salt(salt: object) -> bool:
    return salt is not None and (not isinstance(salt, str) or not salt.strip()
                                 or len(salt) > 128 or any(c in salt for c in "@/\\\0"))


class PrefixMemory:
    """Recent (salt, prompt) pairs: a repeat reports its whole blocks as cached."""

    def __init__(self) -> None:
        self.seen: OrderedDict[str, None] = OrderedDict()

    def cached(self, body: dict, prompt_tokens: int) -> int:
        key = json.dumps([body.get("cache_salt"), body.get("messages") or body.get("prompt")])
        hit = key in self.seen
        self.seen[key] = None
        self.seen.move_to_end(key)
        while len(self.seen) > REMEMBERED_PROMPTS:
            self.seen.popitem(last=False)
        return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE if hit else 0


def build_app(chunks: int, interval_s: float = 0.0, prefill_s: float = 0.0,
              metrics_text: str | None = None) -> web.Application:
    memory = PrefixMemory()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if _bad_salt(body.get("cache_salt")):
            return web.json_response({"error": {"message": SALT_RULE, "type": "BadRequestError",
                                                "param": "cache_salt", "code": 400}},
                                     status=400)
        chat = request.path.endswith("chat/completions")
        prompt = max(1, len(json.dumps(body.get("messages") or body.get("prompt"))) // 4)
        cached = memory.cached(body, prompt)
        n = int(body.get("max_tokens") or chunks)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x" * n},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": "x" * n, "finish_reason": "length"})
            return web.json_response({"id": "cmpl-1", "object": obj, "created": created,
                                      "model": MODEL, "choices": [choice],
                                      "usage": _usage(prompt, n, cached)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # as vLLM: the head at once, the first event after prefill
        if prefill_s:
            await asyncio.sleep(prefill_s)
        obj += ".chunk" if chat else ""
        for i in range(n):
            delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
            chunk = {"id": "cmpl-1", "object": obj, "created": created, "model": MODEL,
                     "choices": [{"index": 0, **delta,
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if interval_s:  # an engine's pace: one event a step
                await asyncio.sleep(interval_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "object": obj, "created": created, "model": MODEL,
                     "choices": [], "usage": _usage(prompt, n, cached)}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "root": MODEL,
            "parent": None, "max_model_len": 2048, "permission": []}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics_text if metrics_text is not None else
                            "# TYPE vllm:cache_config_info gauge\n" + CACHE_CONFIG)

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=0.0,
                        help="pause after each streamed chunk (0: back to back)")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="pause between a stream's head and its first event (a prefill)")
    parser.add_argument("--metrics-file", type=Path, default=None,
                        help="answer /metrics with this exposition (a recorded vLLM one: the "
                        "size a fleet's health checks parse)")
    args = parser.parse_args()
    metrics = None if args.metrics_file is None else args.metrics_file.read_text()
    web.run_app(build_app(args.chunks, args.interval_ms / 1000, args.prefill_ms / 1000,
                          metrics), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
