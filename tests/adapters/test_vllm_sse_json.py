"""What the vLLM driver reads out of an engine's JSON: the standard library's answer, at
orjson's speed (adapters/vllm/sse.py `decode_json_object`)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.vllm.sse import (
    MalformedUpstreamError,
    chunk_from_body,
    chunk_from_event_data,
    decode_json_object,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
SCALARS = st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@given(st.dictionaries(st.text(max_size=8), VALUES, max_size=6), st.booleans())
def test_reads_what_the_standard_library_reads(obj: dict[str, Any], ascii_only: bool) -> None:
    text = json.dumps(obj, ensure_ascii=ascii_only)
    assert decode_json_object(text, "x") == json.loads(text)
    assert decode_json_object(text.encode(), "x") == json.loads(text)


@pytest.mark.parametrize("text", [
    '{"a": NaN}', '{"a": Infinity, "b": -Infinity}', '{"a": 1e400}', '{"a": "\\ud800"}',
    '{"a": 1, "a": 2}', ' {"a": [1, 2.5, -0.0, "\\u00e9"]} ',
])
def test_edge_cases_are_read_as_json_reads_them(text: str) -> None:
    got, want = decode_json_object(text, "x"), json.loads(text)
    assert json.dumps(got) == json.dumps(want)  # NaN != NaN: compare the rendering
    if "NaN" in text:
        assert math.isnan(got["a"])


@pytest.mark.parametrize("text", ["", "[1, 2]", '"text"', "{", '{"a": 1,}', "\ufeff{}",
                                  '{"a": "\x01"}', "null"])
def test_not_a_json_object_is_malformed(text: str) -> None:
    with pytest.raises(MalformedUpstreamError):
        decode_json_object(text, "x")


def test_a_usage_count_past_64_bits_is_malformed() -> None:
    """orjson reads such an integer as a float; usage counts must be integers."""
    usage = '{"usage": {"prompt_tokens": 18446744073709551616, "completion_tokens": 1}}'
    with pytest.raises(MalformedUpstreamError, match="prompt_tokens"):
        chunk_from_body(usage.encode())
    within = usage.replace("18446744073709551616", "18446744073709551615")
    assert chunk_from_body(within.encode()).usage.prompt_tokens == 2**64 - 1  # type: ignore[union-attr]


def test_an_event_is_relayed_as_sent_and_read_for_its_usage() -> None:
    data = ('{"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
            '"prompt_tokens_details":{"cached_tokens":4}}}')
    chunk = chunk_from_event_data(data, more=True)
    assert chunk.raw == data and chunk.more and not chunk.done
    assert chunk.usage is not None
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
            chunk.usage.cached_tokens) == (7, 3, 4)
    assert chunk_from_event_data(" [DONE]").done
