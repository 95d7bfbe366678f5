"""Tiered KV residency, tiers on vs off, side by side in one run (issue 16).

A multi-turn, multi-tenant chat workload whose working set is ~4x the device pool: every
conversation's prompt is its system prompt plus all earlier turns plus a new user message;
conversations take turns round-robin, so a returning conversation's prefix has usually been
evicted from the device pool by the others. Two engines over the same loaded model (fp32, the
torch path) run the same requests, interleaved request by request (the arm that goes first
alternates); the "on" engine has a host tier and a disk tier with start-up-measured restore
rates (the cost model decides restore vs recompute), the "off" engine drops evicted blocks.

Printed: the calibration figures, TTFT p50 per request class (first turn; returning, served
from the device pool / the host tier / the disk tier — classified by where the "on" arm's
blocks came from), the ratio off/on, the cached-token ratio of returning requests, the tiers'
counters, the load average and the CPU flags. Greedy outputs of both arms must agree
token for token (checked). `--dev-setup` instead runs the dev setup's engine (2048 blocks,
no pressure: one chat of growing turns) with and without a 1 GiB host tier, to decide the
dev-setup default: TTFT p50 per arm and the start-up time each took. Run it alone:

    flock /tmp/fak-bench.lock .venv/bin/python bench/kv_tiers.py [--conversations 8]
    flock /tmp/fak-bench.lock .venv/bin/python bench/kv_tiers.py --dev-setup
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from governor.bench.artifact import load_average, machine_line
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.model.weights import load_model
from native_engine.request import SamplingParams
from native_engine.tiering import describe

GIB = 1 << 30


@dataclass
class Conversation:
    tenant: str
    history: list[int]
    turns: int = 0


@dataclass
class Sample:
    cls: str
    ttft: dict[str, float] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    prompt: int = 0


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def run_request(engine: LLMEngine, prompt: list[int], params: SamplingParams
                ) -> tuple[float, list[int], int]:
    """TTFT (add to first token), the output tokens, cached prompt tokens."""
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    ttft = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == req.request_id and out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft, list(req.output_token_ids), req.num_cached_tokens


def promotions(engine: LLMEngine) -> dict[str, int]:
    return {s.medium: s.promotions for s in engine.stats().tiers}


def classify(before: dict[str, int], after: dict[str, int], cached: int, turn: int) -> str:
    if turn == 0:
        return "first turn"
    moved = {m: after[m] - before.get(m, 0) for m in after}
    if not any(moved.values()):
        return "returning, device pool" if cached else "returning, recomputed"
    return "returning, " + ("host tier" if moved.get("CPU", 0) >= moved.get("DISK", 0)
                            else "disk tier")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=84)
    ap.add_argument("--host-blocks", type=int, default=96)
    ap.add_argument("--disk-dir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dev-setup", action="store_true")
    args = ap.parse_args()
    print(f"load at start {load_average()}; CPU: {machine_line()}; "
          f"torch {torch.__version__}")
    loaded = load_model(None, torch.float32)
    if args.dev_setup:
        dev_setup(args, loaded)
        print(f"load at the end {load_average()}")
        return
    bs = 16
    base = EngineConfig(block_size=bs, num_blocks=args.pool_blocks, max_num_batched_tokens=256,
                        dtype="float32", attention_backend="torch", max_model_len=2048
                        if args.pool_blocks * bs >= 2048 else None)
    block_bytes = 2 * loaded.config.num_layers * loaded.config.num_kv_heads \
        * loaded.config.head_dim * bs * 4
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk:
        on_config = replace(base, kv_offloading_size=args.host_blocks * block_bytes / GIB,
                            kv_disk_dir=disk, kv_disk_size=4.0)
        arms = {"off": LLMEngine.from_config(base, loaded=loaded),
                "on": LLMEngine.from_config(on_config, loaded=loaded)}
        tiers = arms["on"].tiers
        assert tiers is not None
        print(f"calibration: prefill {tiers.rates.prefill_tokens_per_s:.0f} tokens/s; "
              f"{describe(tiers)}; block {block_bytes} bytes")
        samples = workload(args, arms, loaded.config.vocab_size)
        report(args, samples, arms, bs)
    print(f"load at the end {load_average()}")


def dev_setup(args: argparse.Namespace, loaded: Any) -> None:
    """The dev setup's engine config, host tier off vs on, no cache pressure."""
    from adapters.native import NativeDriverConfig

    base = NativeDriverConfig().engine
    configs = {"off": base, "on": replace(base, kv_offloading_size=1.0)}
    arms, startup = {}, {}
    for arm, config in configs.items():
        t0 = time.perf_counter()
        arms[arm] = LLMEngine.from_config(config, loaded=loaded)
        startup[arm] = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = loaded.config.vocab_size
    history = tokens(rng, args.system_tokens, vocab)
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    order = ["off", "on"]
    for _ in range(args.turns * 2):
        prompt = history + tokens(rng, args.user_tokens, vocab)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = {}
        order.reverse()
        for arm in order:
            t, outs[arm], _ = run_request(arms[arm], prompt, params)
            ttft[arm].append(t)
        if outs["on"] != outs["off"]:
            raise SystemExit("outputs differ between arms")
        history = prompt + outs["on"]
    for arm in ("off", "on"):
        print(f"dev setup, host tier {arm}: start-up {startup[arm]:.2f}s, TTFT p50 "
              f"{statistics.median(ttft[arm]) * 1e3:.1f}ms over {len(ttft[arm])} turns")
    print(f"TTFT p50 on/off: {statistics.median(ttft['on']) / statistics.median(ttft['off']):.3f}")


def workload(args: argparse.Namespace, arms: dict[str, LLMEngine], vocab: int) -> list[Sample]:
    rng = random.Random(args.seed)
    convs = [Conversation(f"tenant-{i % args.tenants}",
                          tokens(rng, args.system_tokens, vocab))
             for i in range(args.conversations)]
    working_set = sum(args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
                      for _ in convs)
    pool = args.pool_blocks * 16
    print(f"workload: {args.conversations} conversations of {args.tenants} tenants, "
          f"{args.turns} turns round-robin, working set {working_set} tokens = "
          f"{working_set / pool:.1f}x the device pool ({pool} tokens)")
    samples = []
    order = ["off", "on"]
    for turn in range(args.turns):
        for conv in convs:
            prompt = conv.history + tokens(rng, args.user_tokens, vocab)
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                    namespace=conv.tenant)
            sample = Sample("", prompt=len(prompt))
            outputs = {}
            order.reverse()
            for arm in order:
                before = promotions(arms[arm])
                ttft, out, cached = run_request(arms[arm], prompt, params)
                sample.ttft[arm], sample.cached[arm], outputs[arm] = ttft, cached, out
                if arm == "on":
                    sample.cls = classify(before, promotions(arms[arm]), cached, turn)
            if outputs["on"] != outputs["off"]:
                raise SystemExit(f"outputs differ between arms at turn {turn}")
            conv.history = prompt + outputs["on"]
            samples.append(sample)
    return samples


def report(args: argparse.Namespace, samples: list[Sample], arms: dict[str, LLMEngine],
           bs: int) -> None:
    by_class: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_class[s.cls].append(s)
    returning = [s for s in samples if s.cls != "first turn"]
    by_class["all returning"] = returning
    print(f"{'class':<26}{'n':>4}{'TTFT p50 off':>14}{'TTFT p50 on':>13}{'off/on':>8}"
          f"{'worst pair on/off':>19}")
    for cls, group in sorted(by_class.items()):
        off = statistics.median(s.ttft["off"] for s in group)
        on = statistics.median(s.ttft["on"] for s in group)
        worst = max(s.ttft["on"] / s.ttft["off"] for s in group)
        print(f"{cls:<26}{len(group):>4}{off * 1e3:>12.1f}ms{on * 1e3:>11.1f}ms"
              f"{off / on:>8.2f}{worst:>19.2f}")
    for arm in ("off", "on"):
        cached = sum(s.cached[arm] for s in returning)
        prompt = sum(s.prompt for s in returning)
        print(f"cached-token ratio of returning requests, tiers {arm}: {cached / prompt:.3f} "
              f"({cached}/{prompt})")
    for st in arms["on"].stats().tiers:
        print(f"tier {st.medium}: resident {st.resident_blocks} blocks "
              f"({st.resident_bytes / 1e6:.1f} MB), hits {st.hits}, promotions "
              f"{st.promotions}, demotions {st.demotions}, restore failures "
              f"{st.restore_failures}, written {st.bytes_written / 1e6:.1f} MB, read "
              f"{st.bytes_read / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
