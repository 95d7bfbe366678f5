"""What reaches the engine (issue 13, findings 1 and 2): every field the governor does not
know, or that steers the engine's internals, is refused with a 400 naming it unless the
operator enabled its group for the tenant; bounds hold; `max_tokens` is always set.

Checked on the body a ridden vLLM would receive (`governor.pipeline.prepare`, then the vLLM
driver's `forwarded_body`) and end to end through a real governor (aiohttp on loopback,
over the native engine with a tiny random-weight model: these are mechanics)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.native import NativeDriver, NativeDriverConfig
from adapters.vllm.http_driver import forwarded_body
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.errors import GovernorError
from governor.pipeline import PipelineInputs, prepare
from governor.serve import build_governor
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from policies.request_fields import (
    FEATURE_GROUPS,
    GOVERNOR_FIELDS,
    ROUTE_FIELDS,
    FieldRefused,
    FieldRules,
    check_bounds,
    effective_max_tokens,
)
from schemas.engine import EngineCapabilities
from schemas.openai import ChatRequest, CompletionRequest, Route, parse_request
from tests.http_client import HTTP
from tests.native_engine.tiny_model import random_model

from .server_thread import ServerThread

CAPS = EngineCapabilities(engine_kind="vllm", model_id="smollm2", cache_salt=True)
CAP = 32
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
LINK_LOCAL = "http://169.254.169.254/latest/meta-data/"
# Finding 1, as found: each reached vLLM unchanged. (body fields, the param the 400 names)
FOUND: list[tuple[dict[str, Any], str]] = [
    ({"kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 5600,
                             "remote_block_ids": [1, 2]}}, "kv_transfer_params"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": LINK_LOCAL}}]}]},
     "messages.0.content.0.type"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"vllm_xargs": {"x": 1}}, "vllm_xargs"),
    ({"structured_outputs": {"regex": "(a+)+$"}}, "structured_outputs"),
    ({"guided_regex": "(a+)+$"}, "guided_regex"),
    ({"stop": [f"s{i}" for i in range(3000)]}, "stop"),
    ({"logit_bias": {str(i): 1.0 for i in range(2000)}}, "logit_bias"),
    ({"min_tokens": 5000}, "min_tokens"),
    ({"request_id": "someone-elses-id"}, "request_id"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"n": 2}, "n"),
    ({"not_a_field": 1}, "not_a_field"),
]


def inputs(allow: frozenset[str] = frozenset(), unknown: str = "reject",
           media: tuple[str, ...] = ()) -> PipelineInputs:
    return PipelineInputs(FieldRules(allow, unknown, media), CAP, "reject")  # type: ignore[arg-type]


def sent(body: dict[str, Any], pipeline: PipelineInputs, route: Route = "chat"
         ) -> dict[str, Any]:
    """The JSON a ridden vLLM receives for `body`."""
    prepared = prepare(route, body, pipeline, CAPS, "acme", "req-1", "fak1-salt", None)
    return forwarded_body(prepared.request, False, CAPS.model_id)


@pytest.mark.parametrize(("extra", "param"), FOUND)
def test_each_finding_is_refused_naming_its_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(GovernorError) as refused:
        sent({**CHAT, **extra}, inputs())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_an_enabled_group_reaches_the_engine_and_media_only_from_the_allowlist() -> None:
    body = sent({**CHAT, "structured_outputs": {"regex": "[ab]+"}, "request_id": "r-7"},
                inputs(frozenset({"structured_outputs", "request_id"})))
    assert body["structured_outputs"] == {"regex": "[ab]+"} and body["request_id"] == "r-7"
    media = inputs(frozenset({"multimodal"}), media=("https://assets.acme.example/",))
    ok = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://assets.acme.example/cat.png"}}]}
    assert sent({"messages": [ok]}, media)["messages"] == [ok]
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": LINK_LOCAL}}]}
    with pytest.raises(GovernorError) as refused:
        sent({"messages": [bad]}, media)
    assert refused.value.param == "messages.0.content.0.image_url"


def test_unknown_fields_are_dropped_when_the_operator_says_so() -> None:
    body = sent({**CHAT, "not_a_field": 1}, inputs(unknown="drop"))
    assert "not_a_field" not in body
    with pytest.raises(GovernorError):  # a feature group is never merely dropped
        sent({**CHAT, "kv_transfer_params": {}}, inputs(unknown="drop"))


@pytest.mark.parametrize(("requested", "forwarded"), [(None, CAP), (8, 8), (10_000, CAP)])
def test_max_tokens_is_always_set_and_never_above_the_cap(requested: int | None,
                                                         forwarded: int) -> None:
    extra = {} if requested is None else {"max_tokens": requested}
    body = sent({**CHAT, **extra}, inputs())
    assert body["max_tokens"] == body["max_completion_tokens"] == forwarded
    assert sent({"prompt": "x", **extra}, inputs(), "completions")["max_tokens"] == forwarded


NAMES = sorted({n for names in FEATURE_GROUPS.values() for n in names})


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NAMES), st.sets(st.sampled_from(sorted(FEATURE_GROUPS))))
def test_a_group_field_passes_only_with_its_group(name: str, allow: set[str]) -> None:
    group = next(g for g, names in FEATURE_GROUPS.items() if name in names)
    try:
        body = sent({**CHAT, name: {"x": 1}}, inputs(frozenset(allow)))
    except GovernorError as exc:
        assert group not in allow or exc.param != name
        return
    assert group in allow and body[name] == {"x": 1}
    assert not (set(body) - ROUTE_FIELDS["chat"] - GOVERNOR_FIELDS
                - {n for g in allow for n in FEATURE_GROUPS[g]})


# Each bounded field's values: in bounds and out (for RequestLimits' defaults).
BOUNDED_VALUES: dict[str, list[Any]] = {
    "temperature": [0.0, 2.0, 2.5, -1.0], "top_p": [0.5, 1.0, 0.0, 1.5],
    "min_p": [0.0, 1.5], "frequency_penalty": [-2.0, -3.0], "presence_penalty": [2.0, 2.1],
    "repetition_penalty": [1.0, 0.0], "top_k": [-1, 50, -2], "seed": [0, 1 << 63],
    "max_tokens": [1, 0], "max_completion_tokens": [5, 0], "min_tokens": [0, 5000],
    "stop": ["x", ["a", "b"], "", ["a"] * 17, "s" * 257], "stop_token_ids": [[1], [0] * 65],
    "logit_bias": [{"1": 0.5}, {"x": 1.0}, {"1": 101.0}], "bad_words": [["w"], ["w" * 257]],
    "allowed_token_ids": [[1], [1] * 4097], "user": ["u", "u" * 257], "n": [1, 2],
    "stream": [True, False], "stream_options": [{"include_usage": True}],
    "top_logprobs": [0, 21], "best_of": [1, 2], "logprobs": [0, 21],
}
NOT_ON = {"chat": {"best_of", "logprobs"}, "completions": {"max_completion_tokens",
                                                           "top_logprobs"}}
BASE: dict[Route, dict[str, Any]] = {"chat": CHAT, "completions": {"prompt": "x"}}


def bounds_verdict(route: Route, body: dict[str, Any]) -> tuple[str, str] | None:
    parsed = parse_request(route, body)
    try:
        check_bounds(parsed, FieldRules(), effective_max_tokens(parsed.requested_max_tokens,
                                                                CAP))
    except FieldRefused as exc:
        return exc.param, exc.message
    return None


OUT_OF_BOUNDS: list[tuple[Route, str, Any]] = [
    ("chat", "temperature", 2.5), ("chat", "top_p", 0.0), ("chat", "min_p", 1.5),
    ("chat", "frequency_penalty", -3.0), ("chat", "presence_penalty", 2.1),
    ("chat", "repetition_penalty", 0.0), ("chat", "top_k", -2), ("chat", "seed", 1 << 63),
    ("chat", "max_tokens", 0), ("chat", "max_completion_tokens", 0),
    ("chat", "min_tokens", CAP + 1), ("chat", "stop", ""), ("chat", "stop", ["a"] * 17),
    ("chat", "stop_token_ids", [0] * 65), ("chat", "logit_bias", {"x": 1.0}),
    ("chat", "logit_bias", {"1": 101.0}), ("chat", "bad_words", ["w" * 257]),
    ("chat", "allowed_token_ids", [1] * 4097), ("chat", "user", "u" * 257), ("chat", "n", 2),
    ("chat", "stream_options", {"include_usage": True}), ("chat", "top_logprobs", 21),
    ("completions", "best_of", 2), ("completions", "logprobs", 21),
    ("completions", "n", 0), ("completions", "temperature", -1.0),
]


@pytest.mark.parametrize(("route", "name", "value"), OUT_OF_BOUNDS)
def test_each_bound_refuses_naming_its_field(route: Route, name: str, value: Any) -> None:
    verdict = bounds_verdict(route, {**BASE[route], name: value})
    assert verdict is not None and verdict[0] == name


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["chat", "completions"]), st.data())
def test_a_field_left_unset_never_changes_the_bounds_verdict(route: Route,
                                                             data: st.DataObject) -> None:
    """check_bounds looks only at the fields a client set: every other one set to its
    default, explicitly, must give the same verdict."""
    names = sorted(set(BOUNDED_VALUES) - NOT_ON[route])
    chosen = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=4))
    body = {**BASE[route], **{n: data.draw(st.sampled_from(BOUNDED_VALUES[n]))
                              for n in chosen}}
    kind = ChatRequest if route == "chat" else CompletionRequest
    defaults = {name: info.default for name, info in kind.model_fields.items()
                if name not in body}
    assert bounds_verdict(route, body) == bounds_verdict(route, {**body, **defaults})


def test_the_field_refused_does_not_depend_on_the_bodys_order() -> None:
    bad = [("n", 2), ("user", "u" * 300), ("temperature", 9.0), ("stop", "")]
    for order in itertools.permutations(bad):
        assert bounds_verdict("chat", {**CHAT, **dict(order)}) == (
            "temperature", "'temperature' must be a number in [0, 2]")


@pytest.fixture(scope="module")
def governed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    engine = EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=128,
                          max_model_len=256, dtype="float32", attention_backend="torch")
    driver = NativeDriver(NativeDriverConfig(engine=engine, served_model_name="tiny"),
                          LLMEngine.from_config(engine, loaded=random_model(seed=5)))
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("tb"))}, "engine": {"kind": "native"},
        "tenants": [{"id": "acme", "api_key_sha256": [sha256_hex("key-acme")], "max_tokens": 3}]})
    thread = ServerThread()
    thread.run(driver.start())
    gov = build_governor(config, driver, create_key=True)
    yield thread.serve(gov)
    thread.run(driver.close())
    thread.stop()


def test_through_the_governor_each_is_a_400_naming_the_field(governed: str) -> None:
    auth = {"Authorization": "Bearer key-acme"}
    for extra, param in FOUND:
        r = HTTP.post(governed + "/v1/chat/completions", json={**CHAT, **extra},
                      headers=auth, timeout=30)
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = HTTP.post(governed + "/v1/completions", headers=auth, timeout=60,
                  json={"prompt": "hello", "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
