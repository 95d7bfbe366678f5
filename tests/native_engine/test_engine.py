"""LLMEngine over a real (tiny, random-weight) Llama and the real ModelRunner, fp32 torch path:
paged + batched + cached + chunked greedy output equals the dense reference token for token;
exact-span eviction leaves every other cached KV bit-identical; stop handling; cache control."""

from __future__ import annotations

import random

import pytest
import torch

from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.model.loaded import LoadedModel
from native_engine.request import SamplingParams
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.tiny_model import random_model

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return random_model(seed=3)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> ReferenceModel:
    return ReferenceModel(loaded.config, loaded.weights)


def build(loaded: LoadedModel, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 32,
                          "dtype": "float32", "attention_backend": "torch", **kw})
    return LLMEngine.from_config(cfg, loaded=loaded)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    stem = [rng.randint(3, 258) for _ in range(9)]
    out = []
    for i in range(n):
        own = [rng.randint(3, 258) for _ in range(rng.randint(1, 30))]
        out.append(stem[: i % 10] + own)  # some share a stem of varying length
    return out


def expected(reference: ReferenceModel, prompt: list[int], n: int, stops) -> list[int]:
    return reference.greedy_generate(prompt, n, stops)


def run_checked(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()


def test_batched_paged_cached_chunked_greedy_equals_reference(
    loaded: LoadedModel, reference: ReferenceModel
) -> None:
    engine = build(loaded)
    stops = engine.eos_token_ids
    ps = prompts(12)
    want = [expected(reference, p, 12, stops) for p in ps]
    reqs = [engine.add_request(p, GREEDY) for p in ps]
    run_checked(engine)
    assert [r.output_token_ids for r in reqs] == want
    # Warm: the same prompts again hit the cache (not rounded down to blocks) and agree.
    again = [engine.add_request(p, GREEDY) for p in ps]
    run_checked(engine)
    assert [r.output_token_ids for r in again] == want
    assert all(r.num_cached_tokens == r.num_prompt_tokens - 1 for r in again)
    assert any(r.num_cached_tokens % 4 for r in again)


def test_preemption_under_a_small_pool_keeps_outputs(
    loaded: LoadedModel, reference: ReferenceModel
) -> None:
    engine = build(loaded, num_blocks=24, max_num_batched_tokens=16, max_model_len=60)
    ps = prompts(8, seed=1)
    want = [expected(reference, p, 12, engine.eos_token_ids) for p in ps]
    reqs = [engine.add_request(p, GREEDY) for p in ps]
    run_checked(engine)
    assert engine.stats().num_preemptions > 0
    assert [r.output_token_ids for r in reqs] == want


def test_priority_engine_and_stats(loaded: LoadedModel, reference: ReferenceModel) -> None:
    engine = build(loaded, scheduling_policy="priority", max_num_seqs=2)
    ps = prompts(5, seed=2)
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, priority=5 - i))
            for i, p in enumerate(ps)]
    run_checked(engine)
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_token_ids == expected(reference, p, 6, engine.eos_token_ids)
    st = engine.stats()
    assert st.prompt_tokens == sum(map(len, ps)) and st.num_running == st.num_waiting == 0
    assert st.generation_tokens == sum(r.num_output_tokens for r in reqs)
    assert st.prefix_query_tokens >= st.prompt_tokens and st.num_steps > 0


def test_exact_span_eviction_keeps_other_kv_bit_identical(loaded: LoadedModel) -> None:
    engine = build(loaded)
    ps = prompts(10, seed=4)
    target = ps[9]  # shares a 9-token stem with ps[0..8] prefixes of various length
    for p in ps:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=3))
    run_checked(engine)
    cache, runner = engine.cache, engine.runner
    snapshot = {}
    for ns in cache.namespaces:
        for node in cache.nodes(ns):
            path = tuple(cache._path_tokens(node))
            kv = runner.read_slots(torch.tensor(node.slots))
            for j, s in enumerate(node.slots):
                snapshot[path[: node.depth + j + 1]] = (s, [(k[j], v[j]) for k, v in kv])
    start = 5
    evicted = engine.evict_span(None, target, start)
    assert evicted > 0
    engine.check_integrity()
    assert cache.match(None, [*target, 0]).length == start
    kept = 0
    for path, (slot, layers) in snapshot.items():
        on_span = len(path) > start and list(path[: start + 1]) == target[: start + 1]
        now = cache.match(None, [*path, 0])
        if on_span:
            assert now.length <= start
            continue
        assert now.length >= len(path) and now.slots[len(path) - 1] == slot
        again = runner.read_slots(torch.tensor([slot]))
        for (k0, v0), (k1, v1) in zip(layers, again, strict=True):
            assert torch.equal(k0, k1[0]) and torch.equal(v0, v1[0])
        kept += 1
    assert kept > start
    # A new request on the evicted path reuses exactly the span start.
    r = engine.add_request([*target, 1, 2], SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert r.num_cached_tokens == start


def test_evict_span_stops_running_requests_from_recaching(loaded: LoadedModel) -> None:
    engine = build(loaded)
    p = prompts(1, seed=5)[0] + [7] * 12
    r = engine.add_request(p, SamplingParams(temperature=0, max_tokens=6))
    engine.step()
    engine.evict_span(None, p, 4)
    run_checked(engine)
    assert r.is_finished and engine.cache.match(None, [*p, 0]).length == 4


def test_stop_tokens_strings_and_lengths(loaded: LoadedModel) -> None:
    engine = build(loaded)
    p = prompts(1, seed=6)[0]
    free = engine.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    stop_id = free.token_ids[3]
    cut = engine.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                               stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    text = free.text
    assert text and engine.tokenizer.decode(free.token_ids) == text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle.strip("\ufffd"):
        out = engine.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                   stop=[needle]))[0]
        assert out.finish_reason == "stop" and out.text == text[: text.index(needle)]


def test_streamed_deltas_concatenate_to_the_text(loaded: LoadedModel) -> None:
    engine = build(loaded)
    p = prompts(1, seed=7)[0]
    r = engine.add_request(p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                             stop=["zz-never"]))
    deltas, ids = [], []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text_delta)
            ids.extend(out.new_token_ids)
    assert "".join(deltas) == r.output_text == engine.tokenizer.decode(ids)
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 14


def test_seeded_sampling_independent_of_batch(loaded: LoadedModel) -> None:
    p = prompts(1, seed=8)[0]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    alone = build(loaded).generate([p], params)[0].token_ids
    crowd = build(loaded).generate([*prompts(6, seed=9), p],
                                   [SamplingParams(max_tokens=8)] * 6 + [params])[-1].token_ids
    assert alone == crowd


def test_abort_reset_and_validation(loaded: LoadedModel) -> None:
    engine = build(loaded)
    p = prompts(1, seed=10)[0]
    engine.add_request(p, GREEDY, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(p, GREEDY, request_id="x")
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        engine.add_request(p, SamplingParams(priority=1))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * 600, GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([10_000], GREEDY)
    engine.step()
    assert not engine.reset_prefix_cache()  # a request is running
    assert engine.abort("x") and not engine.abort("x")
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.cache.num_tokens > 0 and engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
