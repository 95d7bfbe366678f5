"""A near-instant vLLM-shaped upstream for measuring the governor's own overhead.

Benchmark tool only (docs/reference/benchmarking.md §7: a mock upstream keeps the engine from
dominating); the governor's correctness is tested against real engines. Answers /v1/models,
/metrics, /health and both generation routes, streaming or not, in vLLM 0.32's shapes, at
once. `fak bench overhead --engine` points at it to measure the governor alone
(docs/benchmarks.md); it stays out of the package because serving fake answers is not a
product feature.

    python bench/instant_upstream.py --port 8101 [--chunks 16]
"""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

MODEL = "smollm2"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": None,
                                      "multimodal_tokens": None}}


def build_app(chunks: int) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        prompt = len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
        n = int(body.get("max_tokens") or chunks)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x" * n},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": "x" * n, "finish_reason": "length"})
            return web.json_response({"id": "cmpl-1", "object": obj, "created": created,
                                      "model": MODEL, "choices": [choice],
                                      "usage": _usage(prompt, n)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj += ".chunk" if chat else ""
        for i in range(n):
            delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
            chunk = {"id": "cmpl-1", "object": obj, "created": created, "model": MODEL,
                     "choices": [{"index": 0, **delta,
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "object": obj, "created": created, "model": MODEL,
                     "choices": [], "usage": _usage(prompt, n)}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "root": MODEL,
            "parent": None, "max_model_len": 2048, "permission": []}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="# no engine metrics\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    web.run_app(build_app(args.chunks), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
