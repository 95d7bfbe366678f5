"""The audit log: SEC-12 tamper matrix, SEC-13 anchors, SEC-14 minimisation, crash safety."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import asdict
from pathlib import Path

import hypothesis.strategies as st
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings

from governor.audit import merkle
from governor.audit.cli import cmd_audit_checkpoint, cmd_audit_verify
from governor.audit.entry import (
    AuditLogBusy,
    AuditLogError,
    canonical_json,
    check_append_only,
    checkpoints_path,
    encode_line,
    public_key_path,
    sign_checkpoint,
)
from governor.audit.log import AuditLog, AuditLogConfig, load_or_create_signing_key
from governor.audit.verify import AuditLogCorrupt, verify
from schemas.audit import AuditEvent, AuditRecord, AuditState, Evidence, SignedCheckpoint, SpanRef

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """Injectable wall clock, in seconds."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def event(n: int = 0, tenant: str = "acme") -> AuditEvent:
    return AuditEvent(
        kind="quarantine", actor="admin", state=AuditState.VERIFIED, tenant=tenant,
        plan="salt_rotation", reasons=("exact_span_unsupported_salt_rotation",),
        span=SpanRef(hashlib.sha256(f"span-{n}".encode()).hexdigest(), 32 + n),
        evidence=Evidence(engine_result="ok", old_epoch=n, new_epoch=n + 1),
        request_id=f"req-{n}",
    )


def config(data_dir: Path, every: int = 4) -> AuditLogConfig:
    return AuditLogConfig(data_dir, checkpoint_every_records=every)


def build_log(data_dir: Path, n: int = 10, every: int = 4) -> Path:
    clock = Clock()
    with AuditLog.open(config(data_dir, every), clock=clock) as log:
        for i in range(n):
            clock.now += 1
            log.append(event(i))
        log.check_integrity()
    return data_dir / "audit.log"


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def rebuilt_lines(lines: list[bytes], start: int, key: Ed25519PrivateKey,
                  replace: dict[int, AuditEvent]) -> list[bytes]:
    """Re-encode entries from `start` on, recomputing every prev root (what an attacker does)."""
    frontier = merkle.Frontier()
    for line in lines[:start]:
        frontier.append(merkle.leaf_hash(line))
    out = list(lines[:start])
    for index in range(start, len(lines)):
        old = AuditRecord.from_dict(json.loads(lines[index])["record"])
        record = AuditRecord(index, old.time_ms, replace.get(index, old.event))
        line = encode_line(frontier.root(), record, key)
        frontier.append(merkle.leaf_hash(line))
        out.append(line)
    return out


def test_clean_log_verifies(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    report = verify(log_path)
    assert report.ok and report.first_bad_index is None and not report.problems
    assert report.records == 10 and report.checkpoints == 3 and report.checkpointed_size == 10
    assert report.torn_tail_bytes == 0
    for line in lines_of(log_path):  # canonical: sorted keys, compact
        assert json.dumps(json.loads(line), sort_keys=True, separators=(",", ":")).encode() == line


# --- SEC-12: every edit fails and names the first bad index --------------------------------


def test_every_single_byte_flip_is_named(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    original = log_path.read_bytes()
    lines = lines_of(log_path)
    start = sum(len(line) + 1 for line in lines[:5])
    for offset in range(start, start + len(lines[5]) + 1):  # line 5 and its newline
        flipped = bytearray(original)
        flipped[offset] ^= 0x01
        log_path.write_bytes(bytes(flipped))
        report = verify(log_path)
        assert not report.ok, offset
        assert report.first_bad_index == 5, (offset, report.problems)


def test_deleted_entry_is_named(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    lines = lines_of(log_path)
    write_lines(log_path, lines[:5] + lines[6:])
    report = verify(log_path)
    assert not report.ok and report.first_bad_index == 5


def test_swapped_entries_are_named(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    lines = lines_of(log_path)
    lines[3], lines[7] = lines[7], lines[3]
    write_lines(log_path, lines)
    report = verify(log_path)
    assert not report.ok and report.first_bad_index == 3


def test_inserted_entries_are_named(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    lines = lines_of(log_path)
    write_lines(log_path, [*lines[:6], lines[2], *lines[6:]])  # a replayed genuine entry
    assert verify(log_path).first_bad_index == 6
    forged = rebuilt_lines([*lines[:6], lines[5]], 6, Ed25519PrivateKey.generate(), {})
    write_lines(log_path, forged + lines[6:])  # a well-formed entry signed by another key
    report = verify(log_path)
    assert not report.ok and report.first_bad_index == 6


def test_replace_and_rehash_without_the_key_is_named(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    lines = lines_of(log_path)
    forged = rebuilt_lines(lines, 5, Ed25519PrivateKey.generate(), {5: event(5, "mallory")})
    write_lines(log_path, forged)
    report = verify(log_path)
    assert not report.ok and report.first_bad_index == 5
    assert "signature" in report.problems[0]


def test_replace_and_rehash_with_the_key_fails_on_the_signed_root(tmp_path: Path) -> None:
    """An insider with the signing key re-signs every entry: the checkpoints' signed roots
    still catch it, localised to the checkpoint interval [4, 8) that holds index 5."""
    log_path = build_log(tmp_path)
    key = load_or_create_signing_key(tmp_path / "audit_signing.key")
    write_lines(log_path, rebuilt_lines(lines_of(log_path), 5, key, {5: event(5, "mallory")}))
    report = verify(log_path)
    assert not report.ok
    assert report.first_bad_index == 4
    assert any("[4, 8)" in p for p in report.problems)


def test_edited_checkpoint_is_caught(tmp_path: Path) -> None:
    build_log(tmp_path)
    cps = checkpoints_path(tmp_path / "audit.log")
    lines = lines_of(cps)
    cp = json.loads(lines[1])
    cp["tree_size"] = 7
    lines[1] = json.dumps(cp, sort_keys=True, separators=(",", ":")).encode()
    write_lines(cps, lines)
    report = verify(tmp_path / "audit.log")
    assert not report.ok and any("bad signature" in p for p in report.problems)


def test_writer_refuses_a_tampered_log(tmp_path: Path) -> None:
    log_path = build_log(tmp_path)
    lines = lines_of(log_path)
    write_lines(log_path, lines[:3] + lines[4:])
    with pytest.raises(AuditLogCorrupt) as info:
        AuditLog.open(config(tmp_path))
    assert info.value.report.first_bad_index == 3


# --- SEC-13: truncation and rollback against an anchor ------------------------------------


def anchored_log(tmp_path: Path) -> tuple[Path, SignedCheckpoint]:
    log_path = build_log(tmp_path)
    with AuditLog.open(config(tmp_path)) as log:
        anchor = SignedCheckpoint.from_dict(json.loads(log.export_checkpoint()))
    return log_path, anchor


def drop_checkpoints_above(log_path: Path, size: int) -> None:
    cps = checkpoints_path(log_path)
    write_lines(cps, [line for line in lines_of(cps) if json.loads(line)["tree_size"] <= size])


def test_truncation_needs_the_anchor(tmp_path: Path) -> None:
    log_path, anchor = anchored_log(tmp_path)
    assert verify(log_path, anchor).ok
    write_lines(log_path, lines_of(log_path)[:7])
    drop_checkpoints_above(log_path, 7)
    assert verify(log_path).ok  # self-consistent: exactly why an anchor is needed
    report = verify(log_path, anchor)
    assert not report.ok and report.first_bad_index == 7
    assert "truncated" in report.problems[0]


def test_truncate_and_resign_with_another_key_fails_against_anchor(tmp_path: Path) -> None:
    log_path, anchor = anchored_log(tmp_path)
    other = Ed25519PrivateKey.generate()
    forged = rebuilt_lines(lines_of(log_path)[:7], 0, other, {})
    write_lines(log_path, forged)
    frontier = merkle.Frontier()
    for line in forged:
        frontier.append(merkle.leaf_hash(line))
    cp = sign_checkpoint(other, 7, frontier.root(), anchor.timestamp_ms + 1)
    write_lines(checkpoints_path(log_path), [canonical_json(asdict(cp))])
    public_key_path(log_path).write_text(cp.public_key + "\n")
    assert verify(log_path).ok  # a complete forgery is self-consistent
    report = verify(log_path, anchor)
    assert not report.ok and report.first_bad_index == 0


def test_truncate_then_append_fails_the_consistency_proof(tmp_path: Path) -> None:
    log_path, anchor = anchored_log(tmp_path)
    write_lines(log_path, lines_of(log_path)[:7])
    drop_checkpoints_above(log_path, 7)
    with AuditLog.open(config(tmp_path)) as log:  # the insider's writer accepts it
        for i in range(5):
            log.append(event(100 + i))
        assert log.size == 12
    assert verify(log_path).ok
    report = verify(log_path, anchor)
    assert not report.ok and report.first_bad_index is None
    assert "not the anchored history" in report.problems[0]


def test_an_older_checkpoint_is_rejected_as_rollback(tmp_path: Path) -> None:
    log_path, anchor = anchored_log(tmp_path)
    older = SignedCheckpoint.from_dict(json.loads(lines_of(checkpoints_path(log_path))[0]))
    assert older.tree_size < anchor.tree_size
    problems = check_append_only(anchor, older, [])
    assert any("rollback" in p for p in problems)


def test_honest_growth_passes_the_anchor(tmp_path: Path) -> None:
    log_path, anchor = anchored_log(tmp_path)
    with AuditLog.open(config(tmp_path)) as log:
        for i in range(5):
            log.append(event(200 + i))
        current = SignedCheckpoint.from_dict(json.loads(log.export_checkpoint()))
        proof = log.consistency_proof(anchor.tree_size)
    assert check_append_only(anchor, current, proof) == ()
    report = verify(log_path, anchor)
    assert report.ok and report.records == 15 and report.anchor_size == 10


def test_restored_old_backup_fails_against_anchor(tmp_path: Path) -> None:
    old_dir = tmp_path / "old"
    build_log(old_dir, n=6)
    backup = {p.name: p.read_bytes() for p in old_dir.iterdir()}
    with AuditLog.open(config(old_dir)) as log:
        for i in range(6):
            log.append(event(300 + i))
        anchor = SignedCheckpoint.from_dict(json.loads(log.export_checkpoint()))
    for name, data in backup.items():
        (old_dir / name).write_bytes(data)
    report = verify(old_dir / "audit.log", anchor)
    assert not report.ok and report.first_bad_index == 6


# --- SEC-14: nothing but digests and codes reach the bytes ---------------------------------


CANARY = "Canary prompt: the violet heron XJ-7731 sleeps"


def test_canary_never_reaches_the_log(tmp_path: Path) -> None:
    for smuggle in (
        lambda: SpanRef(CANARY, 4),
        lambda: AuditEvent(kind="quarantine", actor="admin", state=AuditState.FAILED,
                           reasons=(CANARY,)),
        lambda: AuditEvent(kind="quarantine", actor="admin", state=AuditState.FAILED,
                           tenant=CANARY),
        lambda: Evidence(engine_result=CANARY),
    ):
        with pytest.raises(ValueError):
            smuggle()
    span = SpanRef(hashlib.sha256(CANARY.encode()).hexdigest(), len(CANARY.split()))
    with AuditLog.open(config(tmp_path)) as log:
        log.append(AuditEvent(kind="quarantine", actor="admin", state=AuditState.VERIFIED,
                              tenant="acme", span=span))
        exported = log.export_checkpoint()
    needle = CANARY.encode()
    for path in tmp_path.iterdir():
        assert needle not in path.read_bytes(), path
        assert b"heron" not in path.read_bytes(), path
    assert CANARY not in exported


# --- crash safety -------------------------------------------------------------------------


WRITER = textwrap.dedent("""
    import sys, time, os
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from governor.audit.entry import encode_line
    from governor.audit.log import AuditLog, AuditLogConfig, load_or_create_signing_key
    from schemas.audit import AuditEvent, AuditRecord, AuditState
    data_dir, mode = Path(sys.argv[2]), sys.argv[3]
    config = AuditLogConfig(data_dir, checkpoint_every_records=3)
    log = AuditLog.open(config)
    ev = AuditEvent(kind="rotate", actor="governor", state=AuditState.RECORDED, tenant="acme")
    if mode == "loop":
        while True:
            log.append(ev)
            print(log.size, flush=True)
    for _ in range(7):
        log.append(ev)
    line = encode_line(bytes.fromhex(log.root_hash()), AuditRecord(7, 1, ev),
                       load_or_create_signing_key(config.key_path))
    fd = os.open(config.log_path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, line[: len(line) // 2])
    os.fsync(fd)
    print("TORN", len(line) // 2, flush=True)
    time.sleep(120)
""")


def start_writer(data_dir: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), str(data_dir), mode],
                            stdout=subprocess.PIPE, text=True)


def test_kill_9_mid_append_leaves_a_torn_tail_and_nothing_else(tmp_path: Path) -> None:
    writer = start_writer(tmp_path, "torn")
    assert writer.stdout is not None
    marker, torn = writer.stdout.readline().split()
    assert marker == "TORN"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=10)
    log_path = tmp_path / "audit.log"
    report = verify(log_path)
    assert report.ok and report.records == 7 and report.torn_tail_bytes == int(torn)
    assert report.checkpointed_size == 6  # checkpoints at 3 and 6; the close never ran
    assert cmd_audit_verify(log_path) == 3
    with AuditLog.open(config(tmp_path)) as log:  # the writer repairs and records it
        assert log.size == 8
        log.check_integrity()
    report = verify(log_path)
    assert report.ok and report.torn_tail_bytes == 0 and report.records == 8
    (aside,) = tmp_path.glob("audit.log.torn-*")
    assert len(aside.read_bytes()) == int(torn)
    last = AuditRecord.from_dict(json.loads(lines_of(log_path)[-1])["record"])
    assert last.event.kind == "log_recovered"
    assert f"torn_log_tail_bytes={torn}" in last.event.reasons


def test_kill_9_in_an_append_loop_is_clean_or_torn(tmp_path: Path) -> None:
    writer = start_writer(tmp_path, "loop")
    assert writer.stdout is not None
    while int(writer.stdout.readline()) < 25:
        pass
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=10)
    report = verify(tmp_path / "audit.log")
    assert report.ok, report.summary()
    assert report.records >= 25 and report.first_bad_index is None
    with AuditLog.open(config(tmp_path)) as log:
        log.check_integrity()
    assert verify(tmp_path / "audit.log").ok


def test_failed_write_makes_the_log_refuse_appends(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        from governor.audit.entry import AuditLogError
        from governor.audit.log import AuditLog, AuditLogConfig
        from schemas.audit import AuditEvent, AuditState
        log = AuditLog.open(AuditLogConfig(Path(sys.argv[2])))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ev = AuditEvent(kind="rotate", actor="governor", state=AuditState.RECORDED)
        log.append(ev)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        outcomes = []
        for _ in range(3):
            try:
                log.append(ev)
                outcomes.append("ok")
            except AuditLogError as exc:
                outcomes.append("refused" if "refuses" in str(exc) else "failed")
        print(",".join(outcomes))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT), str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    outcomes = out.strip().split(",")
    assert "failed" in outcomes and outcomes[-1] == "refused"
    assert outcomes.index("failed") < outcomes.index("refused")
    report = verify(tmp_path / "audit.log")
    assert report.ok or report.torn_tail_bytes  # a short write is at worst a torn tail


# --- writer behaviour ---------------------------------------------------------------------


def test_checkpoints_by_count_time_and_close(tmp_path: Path) -> None:
    clock = Clock()
    cfg = AuditLogConfig(tmp_path, checkpoint_every_records=100, checkpoint_every_seconds=10)
    log = AuditLog.open(cfg, clock=clock)
    log.append(event(0))
    clock.now += 5
    log.append(event(1))
    assert log.latest_checkpoint is None
    assert log.maybe_checkpoint() is None
    clock.now += 6
    log.append(event(2))  # 11 s since open: due on append
    assert log.latest_checkpoint is not None and log.latest_checkpoint.tree_size == 3
    assert log.latest_checkpoint.timestamp_ms == int(clock.now * 1000)
    log.append(event(3))
    clock.now += 10
    cp = log.maybe_checkpoint()
    assert cp is not None and cp.tree_size == 4
    clock.now += 100
    assert log.maybe_checkpoint() is None  # nothing pending
    log.append(event(4))
    log.close()
    log.close()
    sizes = [json.loads(line)["tree_size"] for line in lines_of(checkpoints_path(cfg.log_path))]
    assert sizes == [3, 4, 5]
    with pytest.raises(AuditLogError, match="closed"):
        log.append(event(5))


def test_single_writer_lock(tmp_path: Path) -> None:
    with AuditLog.open(config(tmp_path)), pytest.raises(AuditLogBusy):
        AuditLog.open(config(tmp_path))
    AuditLog.open(config(tmp_path)).close()


def test_key_file_mode_and_public_key(tmp_path: Path) -> None:
    build_log(tmp_path, n=1)
    key_path = tmp_path / "audit_signing.key"
    assert key_path.stat().st_mode & 0o777 == 0o600
    key_path.chmod(0o644)
    with pytest.raises(AuditLogError, match="0600"):
        AuditLog.open(config(tmp_path))
    key_path.chmod(0o600)
    public_key_path(tmp_path / "audit.log").write_text("00" * 32 + "\n")
    with pytest.raises(AuditLogError, match="does not match"):
        AuditLog.open(config(tmp_path))


def test_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        AuditLogConfig(tmp_path, checkpoint_every_records=0)
    with pytest.raises(ValueError):
        AuditLogConfig(tmp_path, checkpoint_every_seconds=0)
    with pytest.raises(TypeError):
        AuditLogConfig(str(tmp_path))  # type: ignore[arg-type]


# --- CLI entry points ---------------------------------------------------------------------


def test_cmd_audit_verify_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_path, anchor = anchored_log(tmp_path)
    anchor_file = tmp_path / "anchor.json"
    anchor_file.write_text(json.dumps(asdict(anchor)))
    assert cmd_audit_verify(log_path, anchor_file) == 0
    assert "OK" in capsys.readouterr().out
    assert cmd_audit_verify(tmp_path / "missing.log") == 2
    (tmp_path / "bad.json").write_text("{}")
    assert cmd_audit_verify(log_path, tmp_path / "bad.json") == 2
    write_lines(log_path, lines_of(log_path)[:4])
    assert cmd_audit_verify(log_path) == 1  # the local checkpoints still cover 10
    drop_checkpoints_above(log_path, 4)
    assert cmd_audit_verify(log_path) == 0
    assert cmd_audit_verify(log_path, anchor_file) == 1
    assert "truncated" in capsys.readouterr().out


def test_cmd_audit_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_audit_checkpoint(tmp_path / "nowhere") == 2
    build_log(tmp_path, n=5)
    assert cmd_audit_checkpoint(tmp_path) == 0
    cp = SignedCheckpoint.from_dict(json.loads(capsys.readouterr().out))
    assert cp.tree_size == 5 and verify(tmp_path / "audit.log", cp).ok
    with AuditLog.open(config(tmp_path, every=100)) as log:  # a running governor
        log.append(event(9))
        assert cmd_audit_checkpoint(tmp_path) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["tree_size"] == 5
        assert "1 record(s) after this checkpoint" in captured.err


# --- property: any append sequence verifies and proves ------------------------------------


events = st.builds(
    AuditEvent,
    kind=st.sampled_from(["quarantine", "rotate", "refuse", "client_salt_stripped"]),
    actor=st.sampled_from(["admin", "governor", "ops@example"]),
    state=st.sampled_from(list(AuditState)),
    tenant=st.none() | st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True),
    reasons=st.lists(st.from_regex(r"[a-z][a-z0-9_=]{0,20}", fullmatch=True),
                     max_size=3).map(tuple),
    span=st.none() | st.builds(SpanRef, st.binary(min_size=1).map(
        lambda b: hashlib.sha256(b).hexdigest()), st.integers(0, 10_000)),
)


@settings(max_examples=40, deadline=None)
@given(batch=st.lists(st.tuples(events, st.floats(0, 30)), min_size=1, max_size=25),
       every=st.integers(1, 6), data=st.data())
def test_any_append_sequence_verifies_and_proves(batch, every: int, data) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock()
        cfg = AuditLogConfig(Path(tmp), checkpoint_every_records=every,
                             checkpoint_every_seconds=20, fsync=False)
        with AuditLog.open(cfg, clock=clock) as log:
            for ev, pause in batch:
                clock.now += pause
                record = log.append(ev)
                assert record.event == ev
            log.check_integrity()
            root = bytes.fromhex(log.root_hash())
            index = data.draw(st.integers(0, log.size - 1))
            line = lines_of(cfg.log_path)[index]
            proof = [bytes.fromhex(h) for h in log.inclusion_proof(index)]
            assert merkle.verify_inclusion(merkle.leaf_hash(line), index, log.size, proof, root)
            old = data.draw(st.integers(0, log.size))
            old_root = merkle.root([merkle.leaf_hash(x) for x in lines_of(cfg.log_path)[:old]])
            cproof = [bytes.fromhex(h) for h in log.consistency_proof(old)]
            assert merkle.verify_consistency(old, log.size, old_root, root, cproof)
        report = verify(cfg.log_path)
        assert report.ok and report.records == len(batch)
        assert report.checkpointed_size == len(batch)
