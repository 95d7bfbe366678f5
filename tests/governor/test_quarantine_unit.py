"""Quarantine request parsing, span digests, the SEC-11 verdict rule and the CLI's parsing."""

from __future__ import annotations

import argparse
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.admin_client import (
    AdminClientError,
    add_quarantine_parser,
    add_tenants_parser,
    quarantine_body,
)
from governor.quarantine.executors import Facts, QuarantineConfig
from governor.quarantine.service import (
    QuarantineRequest,
    QuarantineRequestError,
    SpanInput,
    span_digest,
    token_payload,
    verdict,
)
from native_engine.cache_control import CutReport
from policies.salts import SaltKey
from schemas.audit import AuditState

KEY = SaltKey(b"k" * 32)


def test_request_from_json_accepts_each_span_form() -> None:
    for span in ({"text": "hello"}, {"messages": [{"role": "user", "content": "hi"}]},
                 {"token_ids": [1, 2, 3]}):
        req = QuarantineRequest.from_json({"tenant": "acme", "span": span, "reason": "t-1"})
        assert req.span.form == next(iter(span)) and req.start == 0 and not req.require_exact
    req = QuarantineRequest.from_json({"tenant": "acme", "span": {"token_ids": [5, 6]},
                                       "reason": "ticket-7", "start": 1, "require_exact": True})
    assert (req.start, req.require_exact, req.span.token_ids) == (1, True, (5, 6))


@pytest.mark.parametrize(("body", "param"), [
    ([], "body"),
    ({"span": {"text": "x"}, "reason": "r"}, "tenant"),
    ({"tenant": "a", "reason": "r"}, "span"),
    ({"tenant": "a", "span": {"text": "x"}}, "reason"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "r", "extra": 1}, "extra"),
    ({"tenant": "a", "span": {}, "reason": "r"}, "span"),
    ({"tenant": "a", "span": {"text": "x", "token_ids": [1]}, "reason": "r"}, "span"),
    ({"tenant": "a", "span": {"text": ""}, "reason": "r"}, "span.text"),
    ({"tenant": "a", "span": {"token_ids": [1, -2]}, "reason": "r"}, "span.token_ids"),
    ({"tenant": "a", "span": {"token_ids": [True]}, "reason": "r"}, "span.token_ids"),
    ({"tenant": "a", "span": {"messages": "hi"}, "reason": "r"}, "span.messages"),
    ({"tenant": "a", "span": {"messages": []}, "reason": "r"}, "span.messages"),
    ({"tenant": "a", "span": {"prompt": "x"}, "reason": "r"}, "span"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "Poisoned by a user"}, "reason"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "r" * 101}, "reason"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "r", "start": -1}, "start"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "r", "start": 1.5}, "start"),
    ({"tenant": "a", "span": {"text": "x"}, "reason": "r", "require_exact": "yes"},
     "require_exact"),
])
def test_bad_requests_name_the_field(body: object, param: str) -> None:
    with pytest.raises(QuarantineRequestError) as info:
        QuarantineRequest.from_json(body)
    assert info.value.param == param


def test_span_digest_is_keyed_and_separates_forms_and_tenants() -> None:
    text = "the poisoned prompt"
    digest = span_digest(KEY, "acme", "text", text.encode())
    assert len(digest) == 64 and digest != hashlib.sha256(text.encode()).hexdigest()
    assert digest == span_digest(KEY, "acme", "text", text.encode())
    assert digest != span_digest(SaltKey(b"j" * 32), "acme", "text", text.encode())
    assert digest != span_digest(KEY, "beta", "text", text.encode())
    assert digest != span_digest(KEY, "acme", "messages", text.encode())
    assert token_payload([1, 2]) != token_payload([258])


def test_probe_request_of_each_form() -> None:
    assert SpanInput(text="x").probe().body == {"prompt": "x"}
    assert SpanInput(token_ids=(3, 4)).probe().body == {"prompt": [3, 4]}
    chat = SpanInput(messages=({"role": "user", "content": "x"},)).probe()
    assert chat.route == "chat" and chat.body["messages"][0]["content"] == "x"


def _facts(engine_ok: bool | None, removal_ok: bool | None, control: int | None,
           after: int | None, threshold: int = 0) -> Facts:
    return Facts(engine_result="e", engine_ok=engine_ok, removal="r", removal_ok=removal_ok,
                 threshold=threshold, probe_control=control, probe_after=after)


@settings(max_examples=200, deadline=None)
@given(engine_ok=st.sampled_from([True, False, None]),
       removal_ok=st.sampled_from([True, False, None]),
       control=st.none() | st.integers(0, 64), after=st.none() | st.integers(0, 64),
       threshold=st.integers(0, 8))
def test_verdict_verified_only_with_all_three_facts(engine_ok, removal_ok, control, after,
                                                     threshold) -> None:
    state, reasons = verdict(_facts(engine_ok, removal_ok, control, after, threshold))
    all_three = (engine_ok is True and removal_ok is True and control is not None
                 and after is not None and control > threshold and after <= threshold)
    contradicted = (engine_ok is False or removal_ok is False
                    or (after is not None and after > threshold))
    assert (state is AuditState.VERIFIED) == all_three
    assert (state is AuditState.FAILED) == contradicted
    if not all_three and not contradicted:
        assert state is AuditState.UNVERIFIED
    assert reasons


def test_verdict_reason_codes() -> None:
    assert verdict(_facts(True, True, 0, 0))[1] == ("probe_control_miss",)
    assert verdict(_facts(True, None, 32, 0))[1] == ("removal_unconfirmed:r",)
    assert verdict(_facts(True, True, 32, 32)) == (AuditState.FAILED, ("probe_hit_after",))


def test_cut_report_problems() -> None:
    clean = CutReport(evicted=5, others_unchanged=True, removed_only_evicted=True,
                      prefix_kept=True, reusable_after=3, removed_blocks=frozenset(),
                      kv_seq=None)
    assert clean.problems(start=3) == []
    assert clean.eviction(10, 3).checks == ("radix_other_namespaces_unchanged",
                                            "radix_span_cut_at_start")
    bad = CutReport(evicted=5, others_unchanged=False, removed_only_evicted=False,
                    prefix_kept=False, reusable_after=9, removed_blocks=frozenset(),
                    kv_seq=None)
    assert bad.problems(start=3) == ["radix_other_namespace_changed", "radix_removed_set_mismatch",
                                     "radix_prefix_before_start_changed",
                                     "radix_span_still_reusable=9"]


@pytest.mark.parametrize("field", ["drain_timeout_s", "retry_interval_s", "kv_timeout_s",
                                   "probe_timeout_s"])
def test_config_rejects_non_positive_waits(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        QuarantineConfig(**{field: 0})
    with pytest.raises(ValueError, match="max_records"):
        QuarantineConfig(max_records=0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fak")
    sub = parser.add_subparsers(dest="command", required=True)
    add_quarantine_parser(sub)
    add_tenants_parser(sub)
    return parser


def test_cli_parsing(tmp_path) -> None:
    p = _parser()
    args = p.parse_args(["quarantine", "--tenant", "acme", "--token-ids", "1,2,3", "--start",
                         "1", "--reason", "ticket-9", "--require-exact", "--url", "http://h:1"])
    assert quarantine_body(args) == {"tenant": "acme", "span": {"token_ids": [1, 2, 3]},
                                     "start": 1, "reason": "ticket-9", "require_exact": True}
    assert args.url == "http://h:1" and args.quarantine_action is None
    show = p.parse_args(["quarantine", "--url", "http://a:1", "show", "q-1"])
    assert (show.quarantine_action, show.id, show.url) == ("show", "q-1", "http://a:1")
    rotate = p.parse_args(["tenants", "rotate", "acme", "--admin-token-env", "MY_TOKEN"])
    assert (rotate.id, rotate.admin_token_env) == ("acme", "MY_TOKEN")
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    args = p.parse_args(["quarantine", "--tenant", "a", "--messages-file", str(messages),
                         "--reason", "r"])
    assert quarantine_body(args)["span"] == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("argv", [
    ["quarantine", "--tenant", "a", "--reason", "r"],
    ["quarantine", "--text", "x", "--reason", "r"],
    ["quarantine", "--tenant", "a", "--text", "x"],
    ["quarantine", "--tenant", "a", "--token-ids", "1,x", "--reason", "r"],
    ["quarantine", "--tenant", "a", "--messages-file", "/nonexistent.json", "--reason", "r"],
])
def test_cli_usage_errors(argv: list[str]) -> None:
    with pytest.raises(AdminClientError):
        quarantine_body(_parser().parse_args(argv))
