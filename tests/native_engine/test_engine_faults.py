"""Failure isolation in LLMEngine (issue 11), faults injected into the real engine over the
tiny real Llama: a request that fails while being sampled, stop-checked or detokenised ends
alone with an error; a failed forward ends only that step's requests; a scheduler failure
escapes `step()` and `rebuild()` gives a clean engine around the same runner. The
pool/cache invariants hold after every step."""

from __future__ import annotations

from collections import defaultdict

import pytest

import native_engine.engine as engine_module
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine, RequestOutput
from native_engine.kvcache.events import KVEventRecorder
from native_engine.model.loaded import LoadedModel
from native_engine.request import SamplingParams
from schemas.kv_events import AllBlocksCleared
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.test_kv_publisher import CollectingPublisher
from tests.native_engine.tiny_model import random_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[10, 20, 30, 40, 50, 60], [11, 21, 31], [10, 20, 30, 40, 77, 78, 79], [5] * 9]


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return random_model(seed=3)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> ReferenceModel:
    return ReferenceModel(loaded.config, loaded.weights)


def build(loaded: LoadedModel, **kw: object) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 32,
                          "dtype": "float32", "attention_backend": "torch", **kw})
    return LLMEngine.from_config(cfg, loaded=loaded)


def run(engine: LLMEngine, ids: list[str]) -> dict[str, list[RequestOutput]]:
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        engine.add_request(prompt, GREEDY, rid)
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
        engine.check_integrity()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_failed(outs: list[RequestOutput], after_tokens: int) -> None:
    last = outs[-1]
    assert last.finished and last.finish_reason == "error"
    assert isinstance(last.error, InjectedFault)
    assert all(o.error is None and not o.finished for o in outs[:-1])
    assert last.num_output_tokens >= after_tokens


def assert_reference(reference: ReferenceModel, outs: list[RequestOutput], prompt: list[int]
                     ) -> None:
    assert tokens(outs) == reference.greedy_generate(prompt, GREEDY.max_tokens, ())
    assert outs[-1].finish_reason == "length" and outs[-1].error is None


@pytest.mark.parametrize("point", ["_check_stop_token", "_detokenize"])
def test_a_request_failing_in_its_stop_check_or_detokenising_ends_alone(
        loaded: LoadedModel, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch,
        point: str) -> None:
    engine = build(loaded)
    real = getattr(engine, point)

    def faulty(req, *args):
        if req.request_id == "victim" and req.num_output_tokens == 3:
            raise InjectedFault(point)
        return real(req, *args)

    monkeypatch.setattr(engine, point, faulty)
    ids = ["r0", "victim", "r2", "r3"]
    outs = run(engine, ids)
    assert_failed(outs["victim"], 3)
    assert len(outs["victim"]) == 3  # two tokens streamed, then the error
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        if rid != "victim":
            assert_reference(reference, outs[rid], prompt)
    assert engine.stats().num_running == 0 and not engine.requests


def test_a_request_whose_sampling_fails_ends_alone(
        loaded: LoadedModel, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build(loaded)
    real = engine_module.sample
    victim = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, seed=7)

    def faulty(logits, params, generators):
        if any(p is victim for p in params):
            raise InjectedFault("sampler")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", faulty)
    engine.add_request(PROMPTS[1], victim, "victim")
    outs = run(engine, ["r0"])
    assert_failed(outs["victim"], 0)
    assert_reference(reference, outs["r0"], PROMPTS[0])


def test_a_failed_forward_ends_that_steps_requests_only(
        loaded: LoadedModel, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences run at a time; the forward of step 3 fails: the two running requests
    end with the error, the two waiting ones run as if nothing happened, and the failed
    requests' prompts, sent again, give the reference output (nothing bad was cached)."""
    engine = build(loaded, max_num_seqs=2)
    real, calls = engine.runner.execute, []

    def faulty(batch):
        calls.append(batch)
        if len(calls) == 3:
            raise InjectedFault("device fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    ids = ["r0", "r1", "r2", "r3"]
    outs = run(engine, ids)
    for rid in ("r0", "r1"):
        assert_failed(outs[rid], 1)
    for rid in ("r2", "r3"):
        assert_reference(reference, outs[rid], PROMPTS[ids.index(rid)])
    again = run(engine, ["again0", "again1"])
    for rid, prompt in zip(("again0", "again1"), PROMPTS, strict=False):
        assert_reference(reference, again[rid], prompt)
        assert again[rid][-1].cached_tokens > 0


def test_a_scheduler_failure_escapes_and_rebuild_gives_a_clean_engine(
        loaded: LoadedModel, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = CollectingPublisher()
    engine = build(loaded)
    engine.listener = KVEventRecorder(publisher)
    engine.rebuild()  # the cache now reports to the recorder
    run(engine, ["warm"])
    stats = engine.stats()
    engine.add_request(PROMPTS[1], GREEDY, "lost")
    engine.step()

    def broken_schedule() -> None:
        raise InjectedFault("scheduler")

    monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
    with pytest.raises(InjectedFault):
        engine.step()
    assert engine.rebuild() == ["lost"]
    engine.check_integrity()
    assert publisher.batches[-1] == [AllBlocksCleared()]
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    after = engine.stats()
    assert after.prompt_tokens > stats.prompt_tokens
    assert after.prefix_query_tokens >= stats.prefix_query_tokens
    outs = run(engine, ["r0", "r1"])
    for rid, prompt in zip(("r0", "r1"), PROMPTS, strict=False):
        assert_reference(reference, outs[rid], prompt)
        assert outs[rid][-1].cached_tokens == 0  # the old cache is gone
