"""The audit writer thread: group commit, nothing acknowledged lost, failed batches cut back,
anchor export, and the checkpoint loop that retries instead of dying (issue 13)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from governor.audit.anchor import latest_anchor
from governor.audit.cli import cmd_audit_verify
from governor.audit.entry import AuditLogError
from governor.audit.log import AuditLog, AuditLogConfig
from governor.audit.verify import verify
from governor.serve import checkpoint_loop
from schemas.audit import AuditEvent, AuditRecord, AuditState

from .audit_rig import cancel_a_maintain_behind, governor_on

ROOT = Path(__file__).resolve().parents[2]


def event(n: int) -> AuditEvent:
    return AuditEvent(kind="rotate", actor="admin", state=AuditState.RECORDED, tenant="acme",
                      request_id=f"req-{n}")


def records_of(log_path: Path) -> list[AuditRecord]:
    return [AuditRecord.from_dict(json.loads(line)["record"])
            for line in log_path.read_bytes().split(b"\n")[:-1]]


def test_concurrent_appends_are_group_committed_off_the_callers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 threads × 125 blocking appends, fsync on: one gap-free log that verifies, far
    fewer commits than records, and every fsync on the writer thread."""
    fsync_threads: list[str] = []
    real_fsync = os.fsync

    def observed_fsync(fd: int) -> None:
        fsync_threads.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", observed_fsync)
    log = AuditLog.open(AuditLogConfig(tmp_path, checkpoint_every_records=100))
    results: list[AuditRecord] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(125):
            record = log.append(event(w * 1000 + i))
            with lock:
                results.append(record)

    fsync_threads.clear()  # opening the log (key creation) fsyncs on this thread
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.check_integrity()
    assert sorted(r.index for r in results) == list(range(2000))
    assert log.records_written == 2000 and log.batches <= 1000, log.batches
    log.close()
    assert set(fsync_threads) == {"fak-audit-writer"}
    report = verify(tmp_path / "audit.log")
    assert report.ok and report.records == 2000 and report.checkpointed_size == 2000
    assert cmd_audit_verify(tmp_path / "audit.log") == 0
    by_index = {r.index: r for r in records_of(tmp_path / "audit.log")}
    assert all(by_index[r.index] == r for r in results)  # each caller got its own record


async def test_append_async_awaits_durability_without_blocking_the_loop(tmp_path: Path) -> None:
    log = AuditLog.open(AuditLogConfig(tmp_path))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    records = await asyncio.gather(*(log.append_async(event(i)) for i in range(500)))
    task.cancel()
    assert [r.index for r in records] == list(range(500))
    assert log.batches <= 10 and ticks > log.batches  # the loop ran while the writer wrote
    assert len(records_of(tmp_path / "audit.log")) == 500  # on disk when answered
    log.close()
    assert verify(tmp_path / "audit.log").ok


async def test_a_cancelled_maintain_leaves_the_writer_alive(tmp_path: Path) -> None:
    """The checkpoint loop is cancelled at shutdown while its `maintain_async` waits behind
    queued appends: the writer must not die answering the cancelled call (it did: every
    later append waited forever and `close` skipped the final checkpoint)."""
    log = AuditLog.open(AuditLogConfig(tmp_path, checkpoint_every_records=10**6))
    queued, last = await cancel_a_maintain_behind(log, [event(i) for i in range(3000)],
                                                  event(3000))
    assert all(f.result(0).index == i for i, f in enumerate(queued)) and last.index == 3000
    log.close()
    assert log.latest_checkpoint is not None and log.latest_checkpoint.tree_size == 3001
    assert verify(tmp_path / "audit.log").ok


ACK_WRITER = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from governor.audit.log import AuditLog, AuditLogConfig
    from schemas.audit import AuditEvent, AuditState
    log = AuditLog.open(AuditLogConfig(Path(sys.argv[2]), checkpoint_every_records=50))
    out = threading.Lock()
    def worker(w):
        n = 0
        while True:
            ev = AuditEvent(kind="rotate", actor="admin", state=AuditState.RECORDED,
                            request_id=f"w{w}-{n}")
            record = log.append(ev)
            with out:
                print(record.index, ev.request_id, flush=True)
            n += 1
    for w in range(8):
        threading.Thread(target=worker, args=(w,), daemon=True).start()
    threading.Event().wait()
""")


def test_kill_9_mid_append_loses_nothing_acknowledged(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", ACK_WRITER, str(ROOT), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    acked: dict[int, str] = {}
    while len(acked) < 400:
        index, request_id = writer.stdout.readline().split()
        acked[int(index)] = request_id
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=10)
    # a kill between two writes of one print leaves a last line cut short: not an ack read
    acked.update(dict((int(i), r) for i, r in (line.split() for line in writer.stdout
                                                if line.endswith("\n"))))
    report = verify(tmp_path / "audit.log")
    assert report.ok, report.summary()
    on_disk = {r.index: r.event.request_id for r in records_of(tmp_path / "audit.log")}
    assert all(on_disk.get(i) == r for i, r in acked.items())
    assert len(set(on_disk.values())) == len(on_disk)  # nothing written twice
    with AuditLog.open(AuditLogConfig(tmp_path)) as log:  # reopens clean (or repaired)
        log.check_integrity()


FAILING_BATCH = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from governor.audit.entry import AuditLogError
    from governor.audit.log import AuditLog, AuditLogConfig
    from schemas.audit import AuditEvent, AuditState
    log = AuditLog.open(AuditLogConfig(Path(sys.argv[2]), checkpoint_every_records=1000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    ev = AuditEvent(kind="rotate", actor="governor", state=AuditState.RECORDED)
    for _ in range(3):
        log.append(ev)
    size = (Path(sys.argv[2]) / "audit.log").stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1500, size + 1500))
    futures = [log.submit(ev) for _ in range(50)]
    ok = failed = 0
    for f in futures:
        try:
            f.result()
            ok += 1
        except AuditLogError:
            failed += 1
    try:
        log.append(ev)
        after = "accepted"
    except AuditLogError as exc:
        after = "refused" if "refuses" in str(exc) else "failed"
    print(ok, failed, after, log.problem() is not None, flush=True)
""")


def test_a_failed_batch_is_cut_back_and_the_log_refuses_after(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes a batch's write fail part-way: no record of that batch stays in
    the file (their callers were told they failed), the acknowledged ones all do, and the
    log refuses further appends (SEC-18)."""
    out = subprocess.run([sys.executable, "-c", FAILING_BATCH, str(ROOT), str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    ok, failed, after, unready = out.split()
    assert int(failed) > 0 and after == "refused" and unready == "True"
    report = verify(tmp_path / "audit.log")
    assert report.ok and report.torn_tail_bytes == 0
    assert report.records == 3 + int(ok)


def test_every_checkpoint_is_exported_to_the_anchor_dir(tmp_path: Path) -> None:
    anchors = tmp_path / "elsewhere" / "anchors"
    key = tmp_path / "keys" / "audit.key"
    config = AuditLogConfig(tmp_path / "data", checkpoint_every_records=4,
                            signing_key_path=key, anchor_dir=anchors)
    with AuditLog.open(config) as log:
        for i in range(10):
            log.append(event(i))
    assert key.is_file() and not (tmp_path / "data" / "audit_signing.key").exists()
    sizes = sorted(json.loads(p.read_text())["tree_size"] for p in anchors.iterdir())
    assert sizes == [4, 8, 10]  # two by count, one at close
    assert latest_anchor(anchors).tree_size == 10
    log_path = tmp_path / "data" / "audit.log"
    assert cmd_audit_verify(log_path, anchors) == 0
    lines = log_path.read_bytes().split(b"\n")[:-1]
    log_path.write_bytes(b"".join(line + b"\n" for line in lines[:9]))
    (tmp_path / "data" / "audit.checkpoints").write_bytes(b"")
    assert cmd_audit_verify(log_path, anchors) == 1  # truncation caught by the anchor


async def test_checkpoint_loop_logs_and_retries_until_the_anchor_dir_works(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real failure (the anchor path is a file, so no checkpoint can be exported) is
    logged once and retried every tick; the loop lives on and exports once it can."""
    anchors = tmp_path / "anchors"
    anchors.write_text("not a directory")
    gov = governor_on(tmp_path / "data", anchor_dir=anchors, checkpoint_every_seconds=0.05)
    caplog.set_level(logging.WARNING)
    loop = asyncio.create_task(checkpoint_loop(gov, every_s=0.05))
    try:
        await gov.rotate("acme", actor="test")
        await asyncio.sleep(0.5)
        assert not loop.done()
        assert gov.audit.latest_checkpoint is not None  # signed, just not exported
        errors = [r for r in caplog.records if r.name == "fak.serve"]
        assert len(errors) == 1 and "cannot export" in errors[0].getMessage()
        anchors.unlink()
        deadline = time.monotonic() + 5
        # the loop logs its recovery once its tick is back on the event loop, a moment after
        # the writer thread made the directory: wait for that line, not for the directory
        while ("recovered" not in caplog.records[-1].getMessage()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        assert "recovered" in caplog.records[-1].getMessage()
        assert latest_anchor(anchors).tree_size == gov.audit.latest_checkpoint.tree_size
        gov.audit.close()
        await asyncio.sleep(0.3)  # a closed log: errors again, still the loop lives
        assert not loop.done()
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


def test_closed_log_refuses_everything(tmp_path: Path) -> None:
    log = AuditLog.open(AuditLogConfig(tmp_path))
    log.close()
    for call in (lambda: log.append(event(0)), log.maybe_checkpoint, log.checkpoint):
        with pytest.raises(AuditLogError, match="closed"):
            call()
    assert log.problem() == "the audit log is closed"
