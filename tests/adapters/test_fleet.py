"""FleetDriver over real loopback servers answering like vLLM 0.32 (tests/adapters/
vllm_imitation.py) and real ZeroMQ KV streams: routing by policy, KV-aware overlap only in
the request's own namespace and only from a SYNCED index, failover before the first byte,
an error after it, start-up refusals, and re-probing before a returning upstream gets
traffic."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from adapters.fleet.driver import FleetConfig, FleetDriver
from adapters.fleet.health import HealthConfig
from adapters.fleet.state import FAILURE_LOG_EVERY_S, Upstream
from adapters.prompt_tokens import PromptTokens
from adapters.vllm.capabilities import CapabilityRefusedError, VLLMDeclarations
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig
from policies.routing import RoutingPolicy
from schemas.engine import EngineError, EngineRequest
from tests.adapters.test_vllm_http_driver import unaccepting_listener
from tests.adapters.test_vllm_kv_subscriber import FakeVLLMSockets, batch_frames, free_port
from tests.adapters.vllm_imitation import Imitation, start_imitation

FAST = HealthConfig(interval_s=0.05, backoff_max_s=0.2)
SLOW = HealthConfig(interval_s=30.0, backoff_max_s=30.0)  # no check within a test's span
BLOCK = 128  # the recorded server's block size


def upstream(name: str, base_url: str, kv: KVEventSubscriber | None = None,
             connect_timeout_s: float = 5.0) -> Upstream:
    driver = VLLMDriver(VLLMHTTPConfig(base_url, connect_timeout_s=connect_timeout_s,
                                       reprobe_interval_s=0.0),
                        VLLMDeclarations(prompt_tokens_details=True), kv=kv)
    return Upstream(name, driver)


def completion(prompt: object, salt: str = "fak1-t", stream: bool = False) -> EngineRequest:
    body = {"prompt": prompt, "max_tokens": 1, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return EngineRequest.of("r", "completions", body, "t", salt)


async def drain(fleet: FleetDriver, request: EngineRequest) -> list:
    return [c async for c in fleet.generate(request)]


@pytest.fixture
async def servers() -> AsyncIterator[list]:
    started = []

    async def start(state: Imitation, port: int = 0):
        runner, url = await start_imitation(state, port)
        started.append(runner)
        return runner, url

    yield start  # type: ignore[misc]
    for runner in started:
        await runner.cleanup()


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_round_robin_then_failover_before_the_first_byte(
        servers, caplog: pytest.LogCaptureFixture) -> None:
    (runner_a, url_a), (_, url_b) = await servers(Imitation()), await servers(Imitation())
    fleet = FleetDriver([upstream("a", url_a), upstream("b", url_b)],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=FAST))
    await fleet.start()
    try:
        for i in range(4):
            assert await drain(fleet, completion(f"hello {i}"))
        assert [m.decisions for m in fleet.members] == [2, 2]
        await runner_a.cleanup()  # upstream a goes away
        with caplog.at_level(logging.WARNING, "fak.fleet"):
            for i in range(4):  # none is lost: a refused connection goes to b before any byte
                assert await drain(fleet, completion(f"again {i}"))
        a, b = fleet.members
        assert a.failovers == a.failures == 1 and not fleet.upstream("a").up
        assert b.decisions == 6 and a.in_flight == b.in_flight == 0 and b.failures == 0
        view = fleet.upstream_views()[0]["ranks"][0]
        assert view["failures"] == 1 and view["last_failure"].startswith("engine unavailable")
        assert [r.getMessage() for r in caplog.records if "before the first byte" in
                r.getMessage()] == [f"1 request(s) failed on a/0 before the first byte, the "
                                    f"last with 502 {a.last_failure} (retried on b/0)"]
        with caplog.at_level(logging.WARNING, "fak.fleet"):
            await asyncio.sleep(4 * FAST.interval_s)  # the health checks find a down: no more
        assert [r.getMessage() for r in caplog.records if "is down" in r.getMessage()] == \
            [f"upstream a is down: {a.last_failure}"]  # one line, from the request's path
        fleet.check_integrity()
    finally:
        await fleet.close()


async def test_a_retry_that_fails_too_is_counted_and_raised(servers) -> None:
    (runner_a, url_a), (runner_b, url_b) = (await servers(Imitation()),
                                            await servers(Imitation()))
    fleet = FleetDriver([upstream("a", url_a), upstream("b", url_b)],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=FAST))
    await fleet.start()
    try:
        await runner_a.cleanup()
        await runner_b.cleanup()  # both gone before the health checks notice
        with pytest.raises(EngineError) as lost:
            await drain(fleet, completion("x"))
        assert lost.value.status == 502
        a, b = fleet.members
        assert (a.failures, a.failovers, b.failures, b.failovers) == (1, 1, 1, 0)
        assert b.last_failure == lost.value.message
        fleet.check_integrity()
    finally:
        await fleet.close()


async def test_a_request_no_engine_had_goes_on_to_each_upstream_once(servers) -> None:
    """Connect timed out on a, refused on b: c answers. Neither failure had reached an
    engine, so one retry is not the limit."""
    (runner_a, url_a), (runner_b, url_b), (_, url_c) = [
        await servers(Imitation()) for _ in range(3)]
    fleet = FleetDriver([upstream(name, url, connect_timeout_s=0.3) for name, url in
                         (("a", url_a), ("b", url_b), ("c", url_c))],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=SLOW))
    await fleet.start()
    try:
        await runner_a.cleanup()
        await runner_b.cleanup()
        with unaccepting_listener(int(url_a.rsplit(":", 1)[1])):
            assert await drain(fleet, completion("x"))
        a, b, c = fleet.members
        assert (a.failures, a.failovers, b.failures, b.failovers) == (1, 1, 1, 1)
        assert a.last_failure == "engine timed out: connect timed out"
        assert b.last_failure.startswith("engine unavailable") and c.failures == 0
        assert not fleet.upstream("a").up and not fleet.upstream("b").up
        fleet.check_integrity()
    finally:
        await fleet.close()


async def test_after_an_answered_5xx_one_retry_is_all(servers) -> None:
    states = [Imitation() for _ in range(3)]
    urls = [(await servers(state))[1] for state in states]
    fleet = FleetDriver([upstream(name, url) for name, url in zip("abc", urls, strict=True)],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=SLOW))
    await fleet.start()
    try:
        for state in states:  # once probed (a probe's request must get its 400)
            state.generation_error = 500
        with pytest.raises(EngineError) as err:
            await drain(fleet, completion("x"))
        assert err.value.status == 500
        asked = [sum(path == "/v1/completions" and isinstance(body, dict)
                     and body.get("prompt") == "x" for _, path, _, body in state.received)
                 for state in states]
        assert asked == [1, 1, 0]
        assert [(m.failures, m.failovers) for m in fleet.members] == [(1, 1), (1, 0), (0, 0)]
        assert all(u.up for u in fleet.upstreams)
        fleet.check_integrity()
    finally:
        await fleet.close()


async def test_a_request_held_back_for_a_re_probe_is_not_an_answered_5xx(servers) -> None:
    """a comes back as an xxhash server and is refused on its re-probe (the request held
    back), b answers 500: the answered 500 still gets its one retry, on c."""
    b_state = Imitation()
    (runner_a, url_a), (_, url_b), (_, url_c) = [
        await servers(state) for state in (Imitation(), b_state, Imitation())]
    fleet = FleetDriver([upstream(name, url) for name, url in
                         (("a", url_a), ("b", url_b), ("c", url_c))],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=SLOW))
    await fleet.start()
    try:
        b_state.generation_error = 500  # once probed (a probe's request must get its 400)
        await runner_a.cleanup()
        await servers(Imitation(hash_algo="xxhash"), int(url_a.rsplit(":", 1)[1]))
        fleet.upstream("a").driver.mark_reconnect()  # as after a lost connection
        assert await drain(fleet, completion("x"))
        a, b, c = fleet.members
        assert a.last_failure.startswith("upstream refused on re-probe")
        assert [(m.failures, m.failovers) for m in (a, b, c)] == [(1, 1), (1, 1), (0, 0)]
        assert not fleet.upstream("a").up and fleet.upstream("b").up
        fleet.check_integrity()
    finally:
        await fleet.close()


def test_failures_are_logged_at_most_once_per_member_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    a0, b0 = upstream("a", "http://127.0.0.1:9").members[0], \
        upstream("b", "http://127.0.0.1:9").members[0]
    busy = EngineError(503, "engine overloaded", type="ServiceUnavailable")
    with caplog.at_level(logging.WARNING, "fak.fleet"):
        for _ in range(3):  # an engine that answers 503 stays up: every request fails there
            a0.note_failure(busy, b0)
        b0.note_failure(busy, None)  # another member has its own interval
        a0.failure_logged_at -= FAILURE_LOG_EVERY_S
        a0.note_failure(busy, None)
    assert [r.getMessage() for r in caplog.records] == [
        "1 request(s) failed on a/0 before the first byte, the last with 503 engine "
        "overloaded (retried on b/0)",
        "1 request(s) failed on b/0 before the first byte, the last with 503 engine "
        "overloaded (not retried)",
        "3 request(s) failed on a/0 before the first byte, the last with 503 engine "
        "overloaded (not retried)"]
    assert (a0.failures, a0.failures_logged, b0.failures) == (4, 4, 1)


async def test_a_failure_after_the_first_byte_is_raised_not_retried(servers) -> None:
    (_, url_a), (_, url_b) = (await servers(Imitation(cut_stream_after=2)),
                              await servers(Imitation()))
    fleet = FleetDriver([upstream("a", url_a), upstream("b", url_b)],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=FAST))
    await fleet.start()
    try:
        chunks = []
        with pytest.raises(EngineError) as cut:
            async for chunk in fleet.generate(completion("x", stream=True)):
                chunks.append(chunk)
        assert chunks and cut.value.status == 502  # the governor sends it as an SSE error
        assert sum(m.failovers for m in fleet.members) == 0
    finally:
        await fleet.close()


async def test_start_up_refuses_an_upstream_that_does_not_isolate(servers) -> None:
    (_, url_a), (_, url_b) = (await servers(Imitation()),
                              await servers(Imitation(hash_algo="xxhash")))
    fleet = FleetDriver([upstream("a", url_a), upstream("b", url_b)], FleetConfig(health=FAST))
    with pytest.raises(CapabilityRefusedError, match=r"upstream b: .*xxhash"):
        await fleet.start()


async def test_returning_upstreams_are_reprobed_before_traffic(servers) -> None:
    """a is down at start; it comes up hashing with xxhash (refused: no traffic), then as a
    proper server (probed, then routed to); then it restarts as a new version."""
    port_a = free_port()
    _, url_b = await servers(Imitation())
    fleet = FleetDriver([upstream("a", f"http://127.0.0.1:{port_a}"), upstream("b", url_b)],
                        FleetConfig(RoutingPolicy.ROUND_ROBIN, health=FAST))
    await fleet.start()
    a = fleet.upstream("a")
    try:
        assert not a.up and fleet.upstream("b").up
        weak_runner, _ = await servers(Imitation(hash_algo="xxhash"), port_a)
        await wait_for(lambda: a.driver.probes >= 2 and a.refusal and "xxhash" in a.refusal)
        for i in range(3):
            assert await drain(fleet, completion(f"p{i}"))
        assert a.members[0].decisions == 0 and not a.up
        await weak_runner.cleanup()
        good = Imitation()
        good_runner, _ = await servers(good, port_a)
        await wait_for(lambda: a.up)
        probed_at = a.probed_at
        assert probed_at is not None and probed_at >= a.down_since
        for i in range(4):
            assert await drain(fleet, completion(f"q{i}"))
        assert a.members[0].decisions >= 1 and a.members[0].last_routed_at > probed_at
        probes = a.driver.probes
        await good_runner.cleanup()
        await servers(Imitation(version="0.32.1"), port_a)
        await wait_for(lambda: a.driver.probes > probes and a.up)
        assert a.driver.capabilities.engine_version == "0.32.1"
        fleet.check_integrity()
    finally:
        await fleet.close()


@pytest.fixture
async def kv_fleet(servers) -> AsyncIterator[tuple[FleetDriver, list[FakeVLLMSockets]]]:
    """Two upstreams whose shadow indexes follow real PUB sockets."""
    ctx = zmq.asyncio.Context()
    engines, ups = [], []
    for name in ("a", "b"):
        port = free_port()
        engine = FakeVLLMSockets(ctx, port)
        kv = KVEventSubscriber(KVSubscriberConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://*:{engine.replay_port}",
            topic="kv"), namespace_key=b"n" * 32)
        engines.append(engine)
        ups.append(upstream(name, (await servers(Imitation()))[1], kv))
    fleet = FleetDriver(ups, FleetConfig(RoutingPolicy.KV_AWARE, health=FAST))
    await fleet.start()
    await asyncio.sleep(0.3)
    yield fleet, engines
    await fleet.close()
    for engine in engines:
        await engine.close()
    ctx.destroy(linger=0)


def stored_chain(tokens: list[int], salt: str, first_hash: int) -> dict:
    blocks = len(tokens) // BLOCK
    return {"type": "BlockStored", "block_hashes": [first_hash + i for i in range(blocks)],
            "parent_block_hash": None, "token_ids": tokens[:blocks * BLOCK],
            "block_size": BLOCK, "medium": "GPU",
            "extra_keys": [[salt], *([None] * (blocks - 1))]}


@pytest.mark.slow
async def test_a_long_text_prompt_is_routed_on_the_same_ids_off_the_loop(
        kv_fleet, chain_threads: list[threading.Thread]) -> None:
    """A 60 KiB text prompt is tokenised on a worker thread (the loop relays meanwhile):
    the decision is the one `route` makes on the loop, credited with b's stored blocks;
    its chain is hashed on that thread as well."""
    fleet, (_, engine_b) = kv_fleet
    fleet.tokens = PromptTokens.load("embedded", 1024)
    text = "ab " * 20_000
    request = completion(text, salt="fak1-alice")
    assert fleet.tokens.is_long(request)
    ids = fleet.tokens.of(request)
    assert ids is not None
    await engine_b.publish(batch_frames(0, [stored_chain(ids.ids[:3 * BLOCK], "fak1-alice",
                                                         700)]))
    b = fleet.upstream("b").driver.kv
    await wait_for(lambda: b is not None and len(b.index()) == 3)
    tokenized = len(fleet.tokenize_seconds)
    off = await fleet.route_off_loop(request)
    assert chain_threads and threading.main_thread() not in chain_threads  # the chain too
    on = fleet.route(request)
    assert [m.name for m in off.order] == [m.name for m in on.order] == ["b/0", "a/0"]
    assert off.predicted == on.predicted and off.predicted["b/0"] == 3 * BLOCK
    assert off.prompt_tokens == on.prompt_tokens == len(ids.ids)
    assert len(fleet.tokenize_seconds) == tokenized + 2
    streamed = asyncio.create_task(drain(fleet, completion(text * 5, salt="fak1-alice")))
    await asyncio.sleep(0.005)
    assert fleet.tokens.cache_lent  # generate routes off the loop too
    assert await streamed


@pytest.mark.slow
async def test_an_early_decision_settles_to_the_one_on_the_whole_prompt(kv_fleet) -> None:
    """A prompt sharing a system prompt with an earlier text of its tenant is routed before
    its new part is tokenised where the known blocks fix the member (b holds 3 of them, a
    none); settled, the decision is the one taken on all its ids. Where another rank holds
    every known block too, the rest could decide: the prompt is tokenised first."""
    fleet, engines = kv_fleet
    fleet.tokens = PromptTokens.load("embedded", 1024)
    whole = PromptTokens.load("embedded")  # no cache: decisions on all the ids
    system = " ".join(f"w{i}" for i in range(300))

    def ask(suffix: str, stream: bool = False) -> EngineRequest:
        return completion(f"{system} {suffix}", salt="fak1-alice", stream=stream)

    ids = whole.of(ask("x"))
    assert ids is not None and len(ids.ids) > 5 * BLOCK
    await engines[1].publish(batch_frames(0, [stored_chain(ids.ids[:3 * BLOCK], "fak1-alice",
                                                           700)]))
    b = fleet.upstream("b").driver.kv
    await wait_for(lambda: b is not None and len(b.index()) == 3)
    assert fleet.route(ask("first")).pending is None  # a miss: tokenised, then decided
    early = fleet.decide(ask("second"))
    assert early.pending is not None and fleet.early_decisions == 1
    assert [m.name for m in early.order] == ["b/0"] and early.predicted == {}
    early.settle()
    fleet.tokens, cached = whole, fleet.tokens
    settled = fleet.route(ask("second"))
    assert [m.name for m in early.order] == [m.name for m in settled.order] == ["b/0", "a/0"]
    assert early.predicted == settled.predicted == {"a/0": 0, "b/0": 3 * BLOCK}
    assert early.prompt_tokens == settled.prompt_tokens
    fleet.tokens = cached
    cached.cache.check_integrity()
    # generate settles an early decision once the request is on its way.
    assert await drain(fleet, ask("third", stream=True))
    assert fleet.early_decisions == 2 and len(fleet.settle_seconds) == 2
    assert fleet.members[1].predicted_tokens == 3 * BLOCK
    # Both hold every block of the system prompt: the new part could decide, so it is
    # tokenised first.
    blocks = len(ids.ids) // BLOCK
    for engine, first_hash in zip(engines, (900, 1900), strict=True):
        await engine.publish(batch_frames(1 if first_hash == 1900 else 0, [stored_chain(
            ids.ids[:blocks * BLOCK], "fak1-alice", first_hash)]))
    a = fleet.upstream("a").driver.kv
    await wait_for(lambda: a is not None and len(a.index()) == blocks
                   and len(b.index()) == blocks + 3)
    full = fleet.decide(ask("fourth"))
    assert full.pending is None and fleet.early_decisions == 2
    assert full.predicted["a/0"] == full.predicted["b/0"] > 3 * BLOCK


async def test_a_text_no_rank_could_match_is_routed_before_it_is_tokenised(kv_fleet) -> None:
    """A tenant's first text, of a namespace no rank holds a block of: every overlap is
    exactly none, so the loads decide before anything is tokenised (ties rotate, as on the
    whole prompt); settled, it is the decision on all the ids. Once a rank holds any block
    of the namespace, an unknown text of it is tokenised first; other tenants still are not."""
    fleet, engines = kv_fleet
    fleet.tokens = PromptTokens.load("embedded", 1024)
    whole = PromptTokens.load("embedded")
    texts = [" ".join(f"v{n}w{i}" for i in range(200)) for n in range(6)]
    # Both ranks synced, holding another tenant's block: carol's namespace is empty on each.
    for engine, first_hash in zip(engines, (300, 400), strict=True):
        await engine.publish(batch_frames(0, [stored_chain(list(range(BLOCK)), "fak1-zed",
                                                           first_hash)]))
    a, b = fleet.upstream("a").driver.kv, fleet.upstream("b").driver.kv
    await wait_for(lambda: a is not None and b is not None and len(a.index()) == 1
                   and len(b.index()) == 1 and a.state().value == b.state().value == "synced")
    fleet.members[1].in_flight = 1  # b is busier: a wins by its load
    early = fleet.decide(completion(texts[0], salt="fak1-carol"))
    assert early.pending is not None and fleet.early_decisions == 1 and early.predicted == {}
    early.settle()
    fleet.tokens, cached = whole, fleet.tokens
    settled = fleet.route(completion(texts[0], salt="fak1-carol"))
    fleet.tokens = cached
    assert [m.name for m in early.order] == [m.name for m in settled.order] == ["a/0", "b/0"]
    assert early.predicted == settled.predicted == {"a/0": 0, "b/0": 0}
    assert early.prompt_tokens == settled.prompt_tokens
    fleet.members[1].in_flight = 0  # a tie: the rotation decides, early too
    firsts = {fleet.decide(completion(text, salt="fak1-carol")).order[0].name
              for text in texts[1:3]}
    assert firsts == {"a/0", "b/0"} and fleet.early_decisions == 3
    ids = whole.of(completion(texts[3], salt="fak1-carol"))
    assert ids is not None
    await engines[1].publish(batch_frames(1, [stored_chain(ids.ids[:BLOCK], "fak1-carol",
                                                           800)]))
    await wait_for(lambda: len(b.index()) == 2 and b.state().value == "synced")
    assert fleet.decide(completion(texts[4], salt="fak1-carol")).pending is None
    assert fleet.decide(completion(texts[5], salt="fak1-dave")).pending is not None
    assert fleet.early_decisions == 4
    fleet.check_integrity()


@pytest.mark.slow
async def test_kv_aware_credits_only_the_requests_namespace_and_synced_ranks(kv_fleet) -> None:
    fleet, (_, engine_b) = kv_fleet
    prompt = list(range(1000, 1000 + 3 * BLOCK + 5))
    await engine_b.publish(batch_frames(0, [stored_chain(prompt, "fak1-alice", 500)]))
    b = fleet.upstream("b").driver.kv
    await wait_for(lambda: b is not None and len(b.index()) == 3)
    first = fleet.route(completion(prompt, salt="fak1-alice"))
    assert [m.name for m in first.order] == ["b/0", "a/0"]
    assert first.predicted["b/0"] == 3 * BLOCK
    # Another tenant's identical prompt earns nothing from alice's blocks.
    for turn in range(4):
        other = fleet.route(completion(prompt, salt="fak1-mallory"))
        assert all(p == 0 for p in other.predicted.values()), turn
    assert {fleet.route(completion(prompt, salt="fak1-mallory")).order[0].name
            for _ in range(4)} == {"a/0", "b/0"}  # ties rotate
    # A gap makes b's index UNCERTAIN: no credit until it is whole again.
    engine_b.mute = True  # the replay of 1..4 never comes
    await engine_b.publish(batch_frames(5, [stored_chain(prompt, "fak1-x", 900)]),
                           buffer=False)
    await wait_for(lambda: b.state().value == "uncertain")
    assert all(p == 0 for p in fleet.route(completion(prompt, salt="fak1-alice"))
               .predicted.values())
