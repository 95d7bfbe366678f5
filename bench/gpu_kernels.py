"""GPU check of the attention kernels: correctness, speed, bandwidth, engine end to end.

Run on a CUDA machine: `python bench/gpu_kernels.py` (from the repository root). Sections:
1. Triton `paged_attention` / `store_kv` against the torch reference on random mixed batches
   (fp32 oracle; tolerances as in tests/native_engine/test_kernels_triton.py).
2. Time against scaled_dot_product_attention on already gathered (dense) KV, and flash-attn
   when importable; triton.testing.do_bench medians (L2 flushed between runs).
3. Decode bytes/s (K+V read once, q and out) against the measured device-to-device copy rate.
4. The engine on the embedded model: greedy output of the CUDA Triton path (float32) equal to
   the CPU torch path's on 10 prompts.
5. The engine's throughput on CUDA (its defaults: bf16, Triton): 1, 16 and 64 concurrent
   random 120-token prompts, 128 output tokens each (issue 18's workload), prefill
   included, after one warm-up round at each level.
Prints one summary table; exits 0 when every check passed, 1 when one failed, 2 without CUDA.
Stays under 5 minutes: a section starting after BUDGET_S is reported as skipped.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from native_engine.kernels import torch_ref
from native_engine.kernels.paged_batch import PagedBatch, make_paged_batch

BUDGET_S = 240.0
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMOLLM2 = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)
LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, overfitting means",
    "The quick brown fox",
    "A haiku about the sea:",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
]


@dataclass
class Row:
    section: str
    case: str
    result: str
    detail: str
    ok: bool = True


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50))


def check_correctness(triton_backend, rows: list[Row]) -> None:
    batches = [
        ("decodes", [1] * 16, [1, 15, 16, 17, *range(100, 1300, 100)]),
        ("prefills+chunks", [37, 256, 5, 1], [37, 300, 2048, 9]),
        ("mixed", [1, 64, 1, 1, 200, 3], [4096, 64, 17, 1, 900, 33]),
    ]
    for shape_name, shape in (("smollm2", SMOLLM2), ("llama8b", LLAMA8B)):
        for dtype, tol in TOLERANCE.items():
            for name, new, ctx in batches:
                batch = make_paged_batch(new, ctx, **shape, page_size=16, dtype=dtype,
                                         device="cuda", seed=len(rows))
                out = triton_backend.paged_attention(*batch.attention_args())
                ref = torch_ref.paged_attention(*batch.to(torch.float32).attention_args())
                err = (out.float() - ref).abs() - tol * ref.abs()
                worst = float(err.max()) if not out.isnan().any() else float("nan")
                ok = worst <= tol
                rows.append(Row("correct", f"attn {shape_name} {name} {str(dtype)[6:]}",
                                "PASS" if ok else "FAIL",
                                f"max excess err {worst:.2e} (atol {tol})", ok))
    check_store(triton_backend, rows)


def check_store(triton_backend, rows: list[Row]) -> None:
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(4096, generator=gen)[:1000]
    slots[::7] = -1
    k, v = torch.randn(2, 1000, 3, 64, generator=gen).cuda().bfloat16()
    caches = [torch.zeros(256, 16, 3, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    torch_ref.store_kv(k, v, caches[0], caches[1], slots.cuda())
    triton_backend.store_kv(k, v, caches[2], caches[3], slots.cuda().int())
    ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    rows.append(Row("correct", "store_kv 1000 tokens bf16", "PASS" if ok else "FAIL",
                    "bitwise equal to torch_ref", ok))


def dense_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V gathered to [R, Hkv, L, D] (all requests have the same context length)."""
    ctx = int(batch.context_lens[0])
    ks = [torch_ref.gather_kv(batch.k_cache, t, ctx) for t in batch.block_tables]
    vs = [torch_ref.gather_kv(batch.v_cache, t, ctx) for t in batch.block_tables]
    return (torch.stack(ks).transpose(1, 2).contiguous(),
            torch.stack(vs).transpose(1, 2).contiguous())


def flash_attn_decode_ms(batch: PagedBatch) -> str:
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return "n/a (flash_attn not importable)"
    num_reqs, ctx = len(batch.context_lens), int(batch.context_lens[0])
    k, v = dense_kv(batch)  # flash-attn's paged path wants pages of 256: use its dense path
    q = batch.q.view(num_reqs, 1, *batch.q.shape[1:])
    ms = bench_ms(lambda: flash_attn_with_kvcache(
        q, k.transpose(1, 2), v.transpose(1, 2),
        cache_seqlens=torch.full((num_reqs,), ctx, dtype=torch.int32, device="cuda"),
        softmax_scale=batch.scale))
    return f"{ms:.3f} ms"


def time_decode(triton_backend, rows: list[Row], copy_gbs: float) -> None:
    cases = [("smollm2", SMOLLM2, 64, 1024), ("smollm2", SMOLLM2, 256, 2048),
             ("smollm2", SMOLLM2, 32, 8192), ("llama8b", LLAMA8B, 64, 2048),
             ("llama8b", LLAMA8B, 16, 8192)]
    for shape_name, shape, num_reqs, ctx in cases:
        batch = make_paged_batch([1] * num_reqs, [ctx] * num_reqs, **shape, page_size=16,
                                 dtype=torch.bfloat16, device="cuda", seed=1)
        args = batch.attention_args()
        t_triton = bench_ms(partial(triton_backend.paged_attention, *args))
        k, v = dense_kv(batch)
        q = batch.q.view(num_reqs, shape["num_q_heads"], 1, shape["head_dim"])
        t_sdpa = bench_ms(partial(sdpa, q, k, v, scale=batch.scale, enable_gqa=True))
        kv_bytes = 2 * k.numel() * k.element_size()
        io_bytes = 2 * batch.q.numel() * batch.q.element_size()
        gbs = (kv_bytes + io_bytes) / t_triton / 1e6
        rows.append(Row("decode", f"{shape_name} bf16 R={num_reqs} ctx={ctx}",
                        f"{t_triton:.3f} ms",
                        f"sdpa(dense) {t_sdpa:.3f} ms; flash {flash_attn_decode_ms(batch)}; "
                        f"{gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy"))


def time_prefill(triton_backend, rows: list[Row]) -> None:
    for num_reqs, n in ((4, 1024), (1, 4096)):
        batch = make_paged_batch([n] * num_reqs, [n] * num_reqs, **SMOLLM2, page_size=16,
                                 dtype=torch.bfloat16, device="cuda", seed=2)
        args = batch.attention_args()
        results = {bm: bench_ms(partial(triton_backend.paged_attention, *args,
                                            block_m=bm, tile_n=64)) for bm in (16, 64, 128)}
        k, v = dense_kv(batch)
        q = batch.q.view(num_reqs, n, 9, 64).transpose(1, 2)
        t_sdpa = bench_ms(partial(sdpa, q, k, v, is_causal=True, scale=batch.scale,
                                 enable_gqa=True))
        best = min(results, key=results.__getitem__)
        tried = ", ".join(f"block_m {bm}: {ms:.3f}" for bm, ms in results.items())
        rows.append(Row("prefill", f"smollm2 bf16 R={num_reqs} n={n}",
                        f"{results[best]:.3f} ms", f"{tried}; sdpa(dense, causal) {t_sdpa:.3f} ms"))


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


def check_engine(rows: list[Row]) -> None:
    try:
        from native_engine.config import EngineConfig
        from native_engine.engine import LLMEngine
        from native_engine.model.weights import load_model
        from native_engine.request import SamplingParams
    except ImportError as exc:
        rows.append(Row("engine", "greedy cuda/triton vs cpu/torch", "engine not available",
                        str(exc), False))
        return
    loaded = load_model(None, torch.float32)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = {}
    for device, backend in (("cpu", "torch"), ("cuda", "triton")):
        config = EngineConfig(num_blocks=512, dtype="float32", attention_backend=backend,
                              device=device)
        engine = LLMEngine.from_config(config, loaded=loaded)
        start = time.perf_counter()
        outputs[device] = [r.token_ids for r in engine.generate(PROMPTS, params)]
        elapsed = time.perf_counter() - start
        rows.append(Row("engine", f"{device}/{backend} fp32 10 prompts x 32 tokens",
                        f"{elapsed:.2f} s", "greedy, ignore_eos"))
    same = sum(a == b for a, b in zip(outputs["cpu"], outputs["cuda"], strict=True))
    rows.append(Row("engine", "greedy cuda/triton == cpu/torch", f"{same}/10 equal",
                    "token ids compared", same == len(PROMPTS)))


def engine_throughput(rows: list[Row], device: str = "cuda",
                      levels: tuple[int, ...] = (1, 16, 64), output_len: int = 128) -> None:
    from native_engine.config import EngineConfig
    from native_engine.engine import LLMEngine
    from native_engine.request import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(num_blocks=4096, device=device))
    compute = engine.model_runner.compute
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for n in levels:
        runs = []
        for _ in range(2):  # a warm-up, then the measured run
            engine.reset_prefix_cache()
            prompts = [[rng.randrange(100, 40000) for _ in range(120)] for _ in range(n)]
            start = time.perf_counter()
            engine.generate(prompts, params)
            runs.append(time.perf_counter() - start)
        rows.append(Row("throughput", f"c{n}: {n} x 120-token prompts, {output_len} out",
                        f"{n * output_len / runs[-1]:.1f} tok/s",
                        f"{compute.dtype} {compute.attention}, prefill included"))


def print_table(rows: list[Row]) -> None:
    widths = [max(len(getattr(r, f)) for r in rows) for f in ("section", "case", "result")]
    head = ("section", "case", "result", "detail")
    print()
    print("  ".join(h.ljust(w) for h, w in zip(head, [*widths, 0], strict=True)))
    for r in rows:
        cells = (r.section, r.case, r.result)
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)), r.detail)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device visible; this check needs a GPU. Nothing measured.")
        return 2
    from native_engine.kernels import select_backend

    triton_backend = select_backend("triton", "cuda")
    rows = [Row("device", torch.cuda.get_device_name(), "", f"torch {torch.__version__}")]
    start = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs()
    rows.append(Row("device", "d2d copy 1 GiB", f"{copy_gbs:.0f} GB/s", "read + write bytes"))
    sections = [
        ("correct", lambda: check_correctness(triton_backend, rows)),
        ("decode", lambda: time_decode(triton_backend, rows, copy_gbs)),
        ("prefill", lambda: time_prefill(triton_backend, rows)),
        ("engine", lambda: check_engine(rows)),
        ("throughput", lambda: engine_throughput(rows)),
    ]
    for name, run in sections:
        if time.perf_counter() - start > BUDGET_S:
            rows.append(Row(name, "skipped", "SKIPPED", "time budget spent", False))
            continue
        try:
            run()
        except Exception as exc:
            rows.append(Row(name, "error", "ERROR", f"{type(exc).__name__}: {exc}"[:200], False))
    rows.append(Row("total", "wall time", f"{time.perf_counter() - start:.1f} s", ""))
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
