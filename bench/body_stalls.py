"""How long one large body holds the governor: the slowest `/health` answer while it is
refused, per body kind (docs/operations.md, `max_body_bytes`).

A real `fak serve` (the embedded native engine, or riding `--upstream-url`, e.g. a
`fak engine serve`), `max_body_bytes` as given, one tenant. Each body fills ~93% of the
limit and is past the engine's context, so it is parsed, checked, tokenised (or encoded for
the upstream) and refused: a plain text prompt, token ids, one long chat message, many
short chat messages. While it is in flight a thread asks `/health` back to back; the
slowest answer is the longest the event loop (every other tenant's stream) stood still.

    flock /tmp/fak-bench.lock .venv/bin/python bench/body_stalls.py [--max-body-bytes 4194304]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from governor.auth import sha256_hex
from governor.bench.artifact import cpu_flags, cpu_model
from governor.bench.governor_proc import running_governor

KEY = "body-stalls-key"


def bodies(limit: int) -> dict[str, tuple[str, bytes]]:
    size = limit * 93 // 100
    texts = {
        "text": ("completions", {"prompt": "a " * (size // 2), "max_tokens": 1}),
        "token ids": ("completions", {"prompt": [11] * (size // 4), "max_tokens": 1}),
        "one long message": ("chat", {"messages": [{"role": "user",
                                                    "content": "a " * (size // 2)}],
                                      "max_tokens": 1}),
        "many messages": ("chat", {"messages": [{"role": "user", "content": "hi"}]
                                   * (size // 34), "max_tokens": 1}),
    }
    return {name: (route, json.dumps(body).encode()) for name, (route, body) in texts.items()}


def write_config(path: Path, limit: int, upstream: str | None) -> None:
    engine = (f'kind = "vllm"\nbase_url = "{upstream}"' if upstream
              else 'kind = "native"\nmax_model_len = 1024\nnum_blocks = 256')
    path.write_text(
        f"[server]\nmax_body_bytes = {limit}\nmax_connections_per_peer = 240\n"
        f'admin_token_sha256 = "{sha256_hex("body-stalls-admin")}"\n\n[engine]\n{engine}\n\n'
        f'[[tenants]]\nid = "m"\nclass = "batch"\nmax_concurrency = 4\nmax_tokens = 8\n'
        f'api_key_sha256 = ["{sha256_hex(KEY)}"]\n')


def one(url: str, route: str, raw: bytes) -> dict[str, Any]:
    stop, health = threading.Event(), []

    def ping() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(url + "/health")
                health.append(time.perf_counter() - started)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(0.2)
    started = time.perf_counter()
    answer = httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                        content=raw, timeout=120, headers={
                            "Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    took = time.perf_counter() - started
    time.sleep(0.1)
    stop.set()
    pinger.join()
    return {"status": answer.status_code, "request_ms": took * 1000,
            "health_max_ms": max(health) * 1000}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--upstream-url", help="ride this engine (vLLM API) instead of the "
                                          "embedded native engine")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, help="the results as JSON")
    args = p.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fak-body-stalls-") as tmp:
        config = Path(tmp) / "fak.toml"
        write_config(config, args.max_body_bytes, args.upstream_url)
        with running_governor(config, Path(tmp) / "run") as governor:
            for name, (route, raw) in bodies(args.max_body_bytes).items():
                results[name] = [one(governor.url, route, raw) for _ in range(args.reps)]
    print(f"CPU: {cpu_model()}; flags: {cpu_flags()}")
    print(f"engine: {args.upstream_url or 'native (embedded)'}; max_body_bytes "
          f"{args.max_body_bytes}")
    for name, runs in results.items():
        print(f"  {name:17s} slowest /health " + ", ".join(
            f"{r['health_max_ms']:.0f} ms of {r['request_ms']:.0f} ms ({r['status']})"
            for r in runs))
    if args.out:
        args.out.write_text(json.dumps({"cpu_flags": cpu_flags(), "cpu_model": cpu_model(),
                                        "max_body_bytes": args.max_body_bytes,
                                        "upstream": args.upstream_url,
                                        "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
