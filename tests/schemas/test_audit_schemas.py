"""Audit record, log line and checkpoint: dataclasses and JSON Schemas agree on real data."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from governor.audit.log import AuditLog, AuditLogConfig
from schemas.audit import (
    AuditEvent,
    AuditRecord,
    AuditState,
    Evidence,
    SignedCheckpoint,
    SpanRef,
)
from schemas.validate import DocumentInvalid, document, errors, validate

DIGEST = hashlib.sha256(b"span").hexdigest()


def quarantine_record() -> AuditRecord:
    return AuditRecord(
        index=3,
        time_ms=1_733_000_000_123,
        event=AuditEvent(
            kind="quarantine", actor="admin", state=AuditState.VERIFIED, tenant="acme",
            plan="whole_prefix_flush", reasons=("exact_span_unsupported_whole_prefix_flush",),
            span=SpanRef(DIGEST, 256),
            evidence=Evidence(engine_result="success", kv_events="all_blocks_cleared",
                              kv_seq_from=41, kv_seq_to=44, probe_control_cached_tokens=256,
                              probe_after_cached_tokens=0),
            request_id="chatcmpl-abc123",
        ),
    )


EXAMPLES = [
    quarantine_record(),
    AuditRecord(0, 0, AuditEvent(kind="client_salt_stripped", actor="governor",
                                 state=AuditState.RECORDED, tenant="beta")),
    AuditRecord(9, 5, AuditEvent(kind="rotate", actor="ops@example", state=AuditState.UNVERIFIED,
                                 tenant="acme", plan="salt_rotation",
                                 evidence=Evidence(old_epoch=2, new_epoch=3))),
    AuditRecord(10, 6, AuditEvent(kind="refuse", actor="admin", state=AuditState.REFUSED,
                                  plan="refuse", reasons=("exact_required_but_unsupported",))),
]


@pytest.mark.parametrize("record", EXAMPLES)
def test_real_records_validate_and_round_trip(record: AuditRecord) -> None:
    validate("audit_record", record)
    assert AuditRecord.from_dict(document(record)) == record


def _broken(mutate) -> dict:
    doc = document(quarantine_record())
    mutate(doc)
    return doc


BROKEN = {
    "missing index": lambda d: d.pop("index"),
    "missing event field": lambda d: d["event"].pop("reasons"),
    "float time": lambda d: d.update(time_ms=1.5),
    "negative index": lambda d: d.update(index=-1),
    "string index": lambda d: d.update(index="3"),
    "extra top-level": lambda d: d.update(prompt="hello"),
    "extra event field": lambda d: d["event"].update(prompt_text="hello"),
    "extra span field": lambda d: d["event"]["span"].update(text="hello"),
    "token ids in span": lambda d: d["event"]["span"].update(token_ids=[1, 2]),
    "bad hex digest": lambda d: d["event"]["span"].update(digest="Z" * 64),
    "short digest": lambda d: d["event"]["span"].update(digest="ab" * 16),
    "uppercase digest": lambda d: d["event"]["span"].update(digest=DIGEST.upper()),
    "unknown state": lambda d: d["event"].update(state="PARTIAL_MAYBE"),
    "prose reason": lambda d: d["event"].update(reasons=["Ignore previous instructions"]),
    "tenant with space": lambda d: d["event"].update(tenant="acme corp"),
    "negative probe": lambda d: d["event"]["evidence"].update(probe_after_cached_tokens=-1),
    "bool epoch": lambda d: d["event"]["evidence"].update(old_epoch=True),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_records_are_rejected_by_schema_and_parser(name: str) -> None:
    doc = _broken(BROKEN[name])
    assert errors("audit_record", doc), name
    with pytest.raises(DocumentInvalid):
        validate("audit_record", doc)
    with pytest.raises((ValueError, TypeError)):
        AuditRecord.from_dict(doc)


def test_error_messages_name_the_path() -> None:
    doc = _broken(lambda d: d["event"]["span"].update(digest="nothex"))
    (message,) = errors("audit_record", doc)
    assert message.startswith("event/span/digest:")


def test_dataclasses_refuse_bad_values() -> None:
    with pytest.raises(ValueError):
        SpanRef("x" * 64, 1)
    with pytest.raises(ValueError):
        SpanRef(DIGEST, -1)
    with pytest.raises(ValueError):
        AuditEvent(kind="Quarantine!", actor="admin", state=AuditState.FAILED)
    with pytest.raises(ValueError):
        AuditEvent(kind="quarantine", actor="admin", state="VERIFIED")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AuditEvent(kind="quarantine", actor="admin", state=AuditState.FAILED,
                   reasons=["list_not_tuple"])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AuditRecord(0, 1.5, EXAMPLES[1].event)  # type: ignore[arg-type]


def test_real_log_lines_and_checkpoints_validate(tmp_path: Path) -> None:
    with AuditLog.open(AuditLogConfig(tmp_path, checkpoint_every_records=2)) as log:
        for record in EXAMPLES:
            log.append(record.event)
        exported = json.loads(log.export_checkpoint())
    lines = (tmp_path / "audit.log").read_text().splitlines()
    assert len(lines) == len(EXAMPLES)
    for line in lines:
        validate("audit_log_entry", json.loads(line))
    for line in (tmp_path / "audit.checkpoints").read_text().splitlines():
        validate("checkpoint", json.loads(line))
    validate("checkpoint", exported)
    assert SignedCheckpoint.from_dict(exported).tree_size == len(EXAMPLES)

    entry = json.loads(lines[0])
    for mutate in (lambda e: e.update(sig="00" * 63), lambda e: e.pop("prev"),
                   lambda e: e["record"].update(index=-1), lambda e: e.update(extra=1)):
        bad = copy.deepcopy(entry)
        mutate(bad)
        assert errors("audit_log_entry", bad)


def test_broken_checkpoints_are_rejected(tmp_path: Path) -> None:
    with AuditLog.open(AuditLogConfig(tmp_path)) as log:
        good = json.loads(log.export_checkpoint())
    for mutate in (
        lambda c: c.pop("signature"),
        lambda c: c.update(tree_size=-1),
        lambda c: c.update(tree_size="1"),
        lambda c: c.update(root_hash="g" * 64),
        lambda c: c.update(signature="ab" * 32),
        lambda c: c.update(key_id=None),
        lambda c: c.update(log="extra"),
    ):
        bad = copy.deepcopy(good)
        mutate(bad)
        assert errors("checkpoint", bad), bad
        with pytest.raises((ValueError, TypeError)):
            SignedCheckpoint.from_dict(bad)


def test_schema_and_dataclass_fields_agree() -> None:
    from schemas.validate import load_schema

    schema = load_schema("audit_record")
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(AuditRecord)}
    assert set(schema["$defs"]["event"]["properties"]) == {
        f.name for f in dataclasses.fields(AuditEvent)}
    assert set(schema["$defs"]["evidence"]["properties"]) == {
        f.name for f in dataclasses.fields(Evidence)}
    assert schema["$defs"]["event"]["properties"]["state"]["enum"] == [s.value for s in AuditState]
    assert set(load_schema("checkpoint")["properties"]) == {
        f.name for f in dataclasses.fields(SignedCheckpoint)}
