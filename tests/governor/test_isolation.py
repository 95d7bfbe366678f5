"""Cross-tenant isolation as a tenant can observe it, on the real SmolLM2 behind
`fak engine serve`, through a real `fak serve` riding it and on the bare engine:

- SEC-5, `fak audit isolation` (Gu et al. 2025): through the governor the cross-tenant KS
  test finds no signal (p ≥ 0.01) while the same-tenant control detects caching (p < 1e-6);
  on the bare engine, where both keys share one namespace, the same command reports the leak
  (p < 1e-6) — the proof that the audit can fail.
- SEC-7, completion order. Under continuous batching requests share engine steps, so the
  order of a tenant's concurrent requests is only defined step by step. B runs a *ticker*
  (a decoding request: exactly one token per engine step) and, once it ticks, a *probe* with
  a long prompt and `max_tokens=1`. The probe's completion lands after some ticker token:
  the number of ticks between sending the probe and its completion is where it falls in B's
  order, and it counts the steps its prefill took (the chunk budget is small, so an uncached
  prefill takes many). The native engine schedules first-come first-served, with no
  cache-aware priority; through the governor, A having cached the probe's prefix must not
  move the probe in B's order at all. Controls show the measure sees reuse when there is
  some: B's own cached prefix (through the governor), and A's on the bare engine.

Sizes (and the audit's run time) are printed with `-s`; the closing note quotes them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.isolation_audit import prefix_sharing_prompt, random_prompt
from tests.integration.native_server import (
    NativeServer,
    NativeServerConfig,
    start_native_server,
    stop_native_server,
)

from .fak_serve_process import REPO_ROOT, FakServe, start_fak_serve, stop_fak_serve, write_config

pytestmark = pytest.mark.slow

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "admin-isolation"
BUDGET = 128  # tokens per engine step: an uncached probe prefill takes many steps
ENGINE = NativeServerConfig(block_size=16, num_blocks=512, max_model_len=2048,
                            max_num_batched_tokens=BUDGET)  # 8192 tokens: nothing planted
                                                            # is evicted during a test
AUDIT_SAMPLES = 16  # per kind and phase: p ≈ 1e-9 when hits and misses separate
AUDIT_PROMPT_TOKENS = 256  # a miss prefills 2 steps of BUDGET, a hit one short step
PROBE_TOKENS = 1280  # an uncached probe: ceil(1280 / 127) = 11 steps of prefill
TICKER_TOKENS = 40
PROBE_STEPS = math.ceil(PROBE_TOKENS / (BUDGET - 1))


@dataclass
class Stack:
    engine: NativeServer
    governor: FakServe


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine = start_native_server(ENGINE)
    root = tmp_path_factory.mktemp("isolation")
    config = root / "fak.toml"
    tenants = {KEY_A: {"id": "tenant-a", "max_concurrency": 4},
               KEY_B: {"id": "tenant-b", "max_concurrency": 4}}
    try:
        write_config(config, {"client_cache_salt": "reject"},
                     {"kind": "vllm", "base_url": engine.base_url}, tenants, ADMIN)
        governor = start_fak_serve(config, root / "data")
    except BaseException:
        stop_native_server(engine)
        raise
    yield Stack(engine, governor)
    stop_fak_serve(governor)
    stop_native_server(engine)


# -- SEC-5: the audit command --------------------------------------------------------------


def audit(url: str, out: Path) -> tuple[int, dict[str, Any], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "governor.cli", "audit", "isolation", "--base-url", url,
         "--key-a", KEY_A, "--key-b", KEY_B, "--samples", str(AUDIT_SAMPLES),
         "--prompt-tokens", str(AUDIT_PROMPT_TOKENS), "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=1200)
    elapsed = time.monotonic() - start
    print(proc.stdout, proc.stderr, f"(load average {os.getloadavg()[0]:.2f})")
    assert proc.returncode in (0, 1, 3), proc.stderr
    report = json.loads(out.read_text())
    assert f"verdict: {report['verdict']}" in proc.stdout
    return proc.returncode, report, elapsed


def test_sec5_audit_finds_no_cross_tenant_signal_through_the_governor(
        stack: Stack, tmp_path: Path) -> None:
    rc, report, elapsed = audit(stack.governor.url, tmp_path / "governor.json")
    cross, control = report["phases"]["cross"], report["phases"]["control"]
    print(f"audit through the governor: {elapsed:.1f} s, {AUDIT_SAMPLES} samples, "
          f"{AUDIT_PROMPT_TOKENS} tokens, p cross {cross['p_value']:.3g}, "
          f"control {control['p_value']:.3g}")
    assert control["p_value"] < 1e-6, report["phases"]
    assert cross["p_value"] >= 0.01, report["phases"]
    assert (rc, report["verdict"]) == (0, "NO CROSS-TENANT SIGNAL")
    # The governor's salts: B's probes never reuse A's tokens, A's own probes do.
    assert report["cached_tokens_median"]["cross"]["hit"] == 0
    assert report["cached_tokens_median"]["control"]["hit"] >= 0.9 * AUDIT_PROMPT_TOKENS
    assert len(report["samples"]) == 4 * AUDIT_SAMPLES
    assert KEY_A not in json.dumps(report) and KEY_B not in json.dumps(report)


def test_sec5_audit_reports_the_leak_on_the_bare_engine(stack: Stack, tmp_path: Path) -> None:
    """No governor, no salts: both keys share the engine's one namespace."""
    rc, report, elapsed = audit(stack.engine.base_url, tmp_path / "bare.json")
    cross = report["phases"]["cross"]
    print(f"audit of the bare engine: {elapsed:.1f} s, p cross {cross['p_value']:.3g}")
    assert cross["p_value"] < 1e-6, report["phases"]
    assert (rc, report["verdict"]) == (1, "LEAK")
    assert report["cached_tokens_median"]["cross"]["hit"] >= 0.9 * AUDIT_PROMPT_TOKENS


# -- SEC-7: completion order ---------------------------------------------------------------


async def ticks_to_complete(url: str, key: str, probe: str) -> int:
    """Ticks of B's ticker between sending the probe and the probe's completion."""
    headers = {"Authorization": f"Bearer {key}"}
    ticks: list[float] = []
    ticking = asyncio.Event()
    ticker_body = {"prompt": "Count slowly:", "max_tokens": TICKER_TOKENS, "ignore_eos": True,
                   "temperature": 0, "stream": True}
    probe_body = {"prompt": probe, "max_tokens": 1, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:

        async def tokens(body: dict[str, Any], on_token: Any) -> None:
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers=headers) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        on_token()

        def tick() -> None:
            ticks.append(time.perf_counter())
            ticking.set()

        done: list[float] = []
        ticker = asyncio.create_task(tokens(ticker_body, tick))
        await asyncio.wait_for(ticking.wait(), 120)
        sent_at = len(ticks)
        await tokens(probe_body, lambda: done.append(time.perf_counter()))
        await ticker
    assert len(ticks) == TICKER_TOKENS and done
    completed_at = sum(t <= done[0] for t in ticks)
    assert completed_at < TICKER_TOKENS, "the ticker stopped before the probe completed"
    return completed_at - sent_at


def plant(url: str, key: str, prompt: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                   headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert r.status_code == 200, r.text


def probe_pair(rng: random.Random) -> tuple[str, str]:
    """A prompt to plant and a probe sharing 95 % of it (Gu et al.'s hit)."""
    planted = random_prompt(rng, PROBE_TOKENS)
    return planted, prefix_sharing_prompt(rng, planted, 0.95)


def ticks(url: str, key: str, probe: str) -> int:
    return asyncio.run(ticks_to_complete(url, key, probe))


def test_sec7_completion_order_ignores_another_tenants_cache(stack: Stack) -> None:
    url, rng = stack.governor.url, random.Random(time.time_ns())
    fresh, planted = [], []
    for _ in range(2):
        _, probe = probe_pair(rng)
        fresh.append(ticks(url, KEY_B, probe))  # nobody has this prefix
        prompt, probe = probe_pair(rng)
        plant(url, KEY_A, prompt)  # A caches the prefix of B's probe
        planted.append(ticks(url, KEY_B, probe))
    own_prompt, own_probe = probe_pair(rng)
    plant(url, KEY_B, own_prompt)  # positive control: B's own cached prefix
    own = ticks(url, KEY_B, own_probe)
    print(f"SEC-7 through the governor ({PROBE_STEPS} prefill steps uncached): ticks fresh "
          f"{fresh}, A planted {planted}, B planted {own}")
    # Uncached, the probe lands after its whole prefill; A's cache does not move it.
    assert min(fresh + planted) >= PROBE_STEPS - 2, (fresh, planted)
    assert max(fresh + planted) - min(fresh + planted) <= 3, (fresh, planted)
    assert own <= 4, own  # with B's own prefix cached it completes within a few steps


def test_sec7_shared_namespace_moves_the_probe(stack: Stack) -> None:
    """The bare engine (no salts): A's cached prefix moves B's probe ahead — the order
    channel the governor closes."""
    url, rng = stack.engine.base_url, random.Random(time.time_ns())
    _, probe = probe_pair(rng)
    fresh = ticks(url, KEY_B, probe)
    prompt, probe = probe_pair(rng)
    plant(url, KEY_A, prompt)
    shared = ticks(url, KEY_B, probe)
    print(f"SEC-7 bare engine: ticks fresh {fresh}, A planted {shared}")
    assert fresh >= PROBE_STEPS - 2 and shared <= 4, (fresh, shared)
