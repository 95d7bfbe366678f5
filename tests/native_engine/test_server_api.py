"""`fak engine serve` without the model: vLLM's request validation answers, the flags, and
`/metrics` text read back by the adapter's own parser."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm.metrics import serving_metrics, snapshot_from_text
from native_engine.engine import EngineStats
from native_engine.serve.metrics import CacheInfo, ServerMetrics
from native_engine.serve.openai_api import (
    check_model,
    parse_json,
    sampling_params,
    validate_body,
)
from native_engine.serve.server import ServerConfig, build_parser, config_from_args
from schemas.engine import EngineError
from schemas.openai import ChatRequest, CompletionRequest

from ..conftest import VECTORS

EDGE_CASES = VECTORS / "vllm-0.32.0-cpu" / "http_edge_cases.txt"


def recorded_error(name: str) -> dict:
    """The error body vLLM answered for one named edge case."""
    for line in EDGE_CASES.read_text().splitlines():
        if line.startswith(name + " ("):
            return ast.literal_eval(line[len(name) + 1:])[4]
        if line.startswith(name + " 4"):
            return json.loads(line.split(" ", 2)[2])["error"]
    raise KeyError(name)


def error_of(call, *args) -> EngineError:
    with pytest.raises(EngineError) as info:
        call(*args)
    return info.value


@pytest.mark.parametrize("name,body", [
    ("bad salt empty", {"prompt": "x", "cache_salt": ""}),
    ("bad salt slash", {"prompt": "x", "cache_salt": "a/b"}),
    ("bad salt long", {"prompt": "x", "cache_salt": "s" * 200}),
    ("prio str", {"prompt": "x", "priority": "high"}),
])
def test_validation_errors_match_recorded_vllm(name: str, body: dict) -> None:
    want = recorded_error(name)
    got = error_of(validate_body, "completions", body)
    assert (got.status, got.type, got.param, got.message) == (
        want["code"], want["type"], want["param"], want["message"])


def test_malformed_json_and_unknown_model_match_recorded_vllm() -> None:
    want = recorded_error("badjson")
    got = error_of(parse_json, b"{bad")
    assert (got.status, got.type, got.param, got.message) == (
        400, want["type"], want["param"], want["message"])
    want = recorded_error("badmodel")
    got = error_of(check_model, validate_body("completions", {"model": "nope"}), "smollm2")
    assert (got.status, got.type, got.param, got.message) == (
        404, want["type"], want["param"], want["message"])


@pytest.mark.parametrize("raw,param", [(b"", "body"), (b"[1, 2", "body.5"), (b"\xff", "body.0")])
def test_bodies_that_are_not_json_name_the_position(raw: bytes, param: str) -> None:
    err = error_of(parse_json, raw)
    assert (err.status, err.type, err.param) == (400, "Bad Request", param)


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"prompt": "x", "max_tokens": "many"}, "body.max_tokens"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "body.temperature"),
    ("completions", {"prompt": "x", "ignore_eos": "perhaps"}, "body.ignore_eos"),
    ("chat", {"messages": "hi"}, "body.messages"),
    ("chat", {}, "body.messages"),
    ("completions", [1, 2], "body"),
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
])
def test_wrong_types_and_unsupported_fields_are_400(route: str, body: object,
                                                    param: str) -> None:
    err = error_of(validate_body, route, body)
    assert (err.status, err.param) == (400, param)


def test_sampling_params_follow_vllm_defaults_and_limits() -> None:
    chat = validate_body("chat", {"messages": [{"role": "user", "content": "x"}],
                                  "logprobs": True, "top_logprobs": 3, "priority": -2,
                                  "stop": "END", "cache_salt": "t1"})
    assert isinstance(chat, ChatRequest)
    p = sampling_params(chat, 10, 100, (2,), priority_enabled=True)
    assert (p.max_tokens, p.logprobs, p.priority, p.stop, p.namespace) == (90, 3, -2, ("END",),
                                                                           "t1")
    assert 2 in p.stop_token_ids
    comp = validate_body("completions", {"prompt": [1, 2], "priority": 5, "ignore_eos": True})
    assert isinstance(comp, CompletionRequest)
    p = sampling_params(comp, 2, 100, (), priority_enabled=False)
    assert (p.max_tokens, p.priority, p.ignore_eos, p.logprobs) == (16, 0, True, None)
    # ignore_eos ignores every end-of-generation id of the model, not only the EOS
    assert sampling_params(comp, 2, 100, (2, 7), priority_enabled=False).stop_token_ids == ()
    assert error_of(sampling_params, comp, 100, 100, (), True).param == "input_tokens"
    # vLLM 0.32 clamps max_tokens to the room the prompt leaves (its get_max_tokens).
    big = validate_body("completions", {"prompt": "x", "max_tokens": 99})
    assert sampling_params(big, 2, 100, (), True).max_tokens == 98
    zero = validate_body("completions", {"prompt": "x", "max_tokens": 0})
    assert error_of(sampling_params, zero, 2, 100, (), True).param == "max_tokens"


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=140), st.integers(), st.none()))
def test_salt_rule_is_the_policy_rule(salt: object) -> None:
    from policies.salts import validate_vllm_cache_salt

    expected = validate_vllm_cache_salt(salt)
    try:
        validate_body("completions", {"prompt": "x", "cache_salt": salt})
    except EngineError as err:
        assert expected is not None or err.param == "body.cache_salt"
        if expected is not None:
            assert (err.type, err.param, err.message) == ("BadRequestError", "cache_salt",
                                                          expected)
    else:
        assert expected is None


def test_flags_mirror_vllm_and_bad_values_are_refused() -> None:
    parser = build_parser()
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                     "topic": "kv"})
    args = parser.parse_args([
        "--port", "9001", "--served-model-name", "m", "--max-model-len", "512",
        "--block-size", "32", "--num-gpu-blocks-override", "40", "--kv-events-config", kv,
        "--enable-prompt-tokens-details", "--scheduling-policy", "priority", "--dev-mode",
        "--attention-backend", "torch", "--dtype", "float32", "--device", "cpu"])
    config = config_from_args(args)
    assert (config.port, config.model_name, config.num_blocks, config.block_size) == (
        9001, "m", 40, 32)
    assert config.kv_events.active and config.kv_events.topic == "kv" and config.dev_mode
    assert config.engine_config().scheduling_policy == "priority"
    assert parser.parse_args(["--num-blocks", "7"]).num_blocks == 7
    assert config_from_args(parser.parse_args([])).model_name == "smollm2"
    for bad in (["--max-model-len", "4096", "--num-blocks", "8"], ["--dtype", "fp7"],
                ["--kv-events-config", '{"nope": 1}'], ["--block-size", "0"]):
        with pytest.raises(ValueError):
            config_from_args(parser.parse_args(bad))
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    assert isinstance(args, argparse.Namespace)


def stats(**over: float) -> EngineStats:
    base = dict(prompt_tokens=100, generation_tokens=20, prefix_query_tokens=100,
                prefix_hit_tokens=40, num_preemptions=1, num_running=2, num_waiting=3,
                kv_usage=0.25, num_steps=9)
    return EngineStats(**{**base, **over})


def test_metrics_parse_into_a_complete_serving_record() -> None:
    metrics = ServerMetrics("smollm2", CacheInfo(32, 64, True))
    for reason in ("length", "stop"):
        timer = metrics.track()
        timer.on_output(1)
        timer.on_output(1)
        timer.on_finish(reason)
    first = stats()
    metrics.update(first)
    metrics.check_integrity(first)
    text = metrics.render().decode()
    assert "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"smollm2\"} 100.0" in text
    assert "vllm:prefix_cache_queries_created" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text
    before = snapshot_from_text(text, "smollm2")
    assert before.block_size == 32
    record = serving_metrics(before)
    missing = [f.name for f in dataclasses.fields(record) if getattr(record, f.name) is None]
    assert not missing, missing
    second = stats(prefix_query_tokens=200, prefix_hit_tokens=90, prompt_tokens=200)
    metrics.update(second)
    metrics.check_integrity(second)
    window = serving_metrics(snapshot_from_text(metrics.render().decode(), "smollm2"), before)
    assert window.prefix_cache_hit_ratio == pytest.approx(0.5)
    assert (window.running, window.waiting, window.kv_usage) == (2, 3, 0.25)
    assert window.ttft_p50 is None  # no request finished in this window: no false zero


def test_metrics_registries_are_private() -> None:
    a, b = (ServerMetrics(n, CacheInfo(16, 8, True)) for n in ("a", "b"))
    a.update(stats())
    assert 'model_name="b"' not in a.render().decode()
    assert "vllm:prompt_tokens_total{" in b.render().decode()
