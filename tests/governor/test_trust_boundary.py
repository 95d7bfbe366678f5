"""What reaches the engine (issue 13, findings 1 and 2): every field the governor does not
know, or that steers the engine's internals, is refused with a 400 naming it unless the
operator enabled its group for the tenant; bounds hold; `max_tokens` is always set.

Checked on the body a ridden vLLM would receive (`governor.pipeline.prepare`, then the vLLM
driver's `forwarded_body`) and end to end through a real governor (aiohttp on loopback,
over the native engine with a tiny random-weight model: these are mechanics)."""

from __future__ import annotations

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
from policies.request_fields import FEATURE_GROUPS, GOVERNOR_FIELDS, ROUTE_FIELDS, FieldRules
from schemas.engine import EngineCapabilities
from schemas.openai import Route
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
