"""The native engine's speed per compute choice, side by side in one process (issue 18).

Each arm is an engine over the embedded model built with one `--dtype` (its linears, decode
attention dtype and threads follow from the machine, as in `fak engine serve`). The tests
run in turn and, within a test, the arms alternate round by round (the arm that goes first
flips each round); medians are printed with every round, the load average and CPU flags:

- `ttft1000`: a cold 1,000-token prompt (prefix cache emptied), one output token: seconds.
- `c1`: batch-1 decode of 31 tokens after a 120-token prompt: tokens/s (prefill excluded).
- `cN`: N concurrent 120-token prompts, 32 output tokens each, prefill included: tokens/s.

    flock /tmp/fak-bench.lock .venv/bin/python bench/native_speed.py \\
        --arms fp32=float32,bf16=bfloat16 --tests ttft1000,c1,c16,c64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.kernels.cpu_features import CPU_FLAGS
from native_engine.model.machine import reported_flags
from native_engine.request import SamplingParams

PROMPT_LEN = 120
OUTPUT_LEN = 32
COLD_LEN = 1000


def run_test(engine: LLMEngine, test: str, rng: random.Random) -> float:
    """One measurement of `test` on `engine` (seconds for ttft1000, else tokens/s)."""
    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    engine.reset_prefix_cache()
    if test == "ttft1000":
        cold = prompt(COLD_LEN)
        start = time.perf_counter()
        engine.generate([cold], SamplingParams(temperature=0, max_tokens=1))
        return time.perf_counter() - start
    concurrency = int(test.removeprefix("c"))
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    prompts = [prompt(PROMPT_LEN) for _ in range(concurrency)]
    if concurrency == 1:
        engine.add_request(prompts[0], params)
        engine.step()  # the prefill and the first token
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (OUTPUT_LEN - 1) / (time.perf_counter() - start)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return concurrency * OUTPUT_LEN / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="fp32=float32,bf16=bfloat16",
                   help="NAME=DTYPE,... (auto, float32, bfloat16)")
    p.add_argument("--tests", default="ttft1000,c1,c16,c64")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    arms = dict(a.split("=", 1) for a in args.arms.split(","))
    tests = args.tests.split(",")
    for t in tests:
        if t != "ttft1000" and not (t.startswith("c") and t[1:].isdigit() and int(t[1:]) > 0):
            p.error(f"unknown test {t!r}")
    print("cpu flags:", ",".join(reported_flags(CPU_FLAGS)) or "-", "| load", os.getloadavg())
    engines = {}
    for name, dtype in arms.items():
        start = time.perf_counter()
        engines[name] = LLMEngine.from_config(EngineConfig(dtype=dtype, num_blocks=2048))
        print(f"{name}: built in {time.perf_counter() - start:.2f} s;",
              engines[name].model_runner.compute.describe(), flush=True)
    rng = random.Random(0)
    for test in tests:
        for engine in engines.values():
            run_test(engine, test, rng)  # warm-up
        results: dict[str, list[float]] = {name: [] for name in arms}
        order = list(arms)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                results[name].append(run_test(engines[name], test, rng))
        unit = "s" if test == "ttft1000" else "tok/s"
        cells = [f"{n} {statistics.median(v):.3f} {unit} {[round(x, 2) for x in v]}"
                 for n, v in results.items()]
        print(f"{test}: " + " | ".join(cells), "| load", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
