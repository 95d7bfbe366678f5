"""A rotation on a full disk neither bumps the epoch nor answers success; readiness says why
(issue 13, finding 4; SEC-18). The disk is a real 512 KiB tmpfs mount (TinyDisk)."""

from __future__ import annotations

import json
from pathlib import Path

from governor.audit.verify import verify
from governor.secrets import EPOCHS_FILE
from policies.salts import tenant_salt
from schemas.audit import AuditRecord
from tests.http_client import HTTP

from .audit_rig import ADMIN_HEADERS, governor_on, tiny_disk
from .server_thread import ServerThread


def rotate_records(log_path: Path) -> list[AuditRecord]:
    records = [AuditRecord.from_dict(json.loads(line)["record"])
               for line in log_path.read_bytes().split(b"\n")[:-1]]
    return [r for r in records if r.event.kind == "rotate"]


def epoch_of(url: str, tenant: str) -> int:
    tenants = HTTP.get(url + "/admin/v1/tenants", headers=ADMIN_HEADERS).json()["data"]
    return next(t["epoch"] for t in tenants if t["id"] == tenant)


def test_rotation_on_a_full_disk_neither_bumps_nor_answers_success(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "disk") as disk:
        data = disk.path / "data"
        thread = ServerThread()
        try:
            gov = governor_on(data, min_free_bytes=4096)
            url = thread.serve(gov)
            rotate = url + "/admin/v1/tenants/acme/rotate"
            assert HTTP.post(rotate, headers=ADMIN_HEADERS).status_code == 200
            assert gov.audit_ready()
            disk.fill()
            if disk.how == "tmpfs":
                assert not gov.audit_ready() and "bytes free" in (gov.audit_problem() or "")
            # Records that still fit in the log's last page are written; the first that
            # needs a new one fails and must change nothing.
            for _ in range(200):
                before, salt = epoch_of(url, "acme"), gov.salt_for("acme")
                r = HTTP.post(rotate, headers=ADMIN_HEADERS)
                if r.status_code != 200:
                    break
                assert epoch_of(url, "acme") == before + 1
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "server_error"
            assert "epoch is unchanged" in r.json()["error"]["message"]
            assert epoch_of(url, "acme") == before and gov.salt_for("acme") == salt
            assert salt == tenant_salt(gov.salt_key, "acme", before)
            r = HTTP.post(rotate, headers=ADMIN_HEADERS)  # fails closed from now on
            assert r.status_code == 503 and "refuses" in r.json()["error"]["message"]
            assert not gov.audit_ready() and "refuses" in (gov.audit_problem() or "")
            assert epoch_of(url, "acme") == before
            salty = HTTP.post(url + "/v1/completions", json={"prompt": "x", "cache_salt": "s"},
                              headers={"Authorization": "Bearer key-acme"})
            assert salty.status_code == 503  # a client event that cannot be recorded
            header = HTTP.post(url + "/v1/completions", json={"prompt": "x"},
                               headers={"Authorization": "Bearer key-acme",
                                        "X-Cache-Salt": "s"})  # dropped, so audited first
            assert header.status_code == 503, header.text
            assert "audit log cannot be written" in header.json()["error"]["message"]
        finally:
            thread.stop()
            gov.audit.close()
        report = verify(data / "audit.log")
        assert report.ok and report.torn_tail_bytes == 0, report.summary()
        rotations = rotate_records(data / "audit.log")
        assert len(rotations) == before and rotations[-1].event.evidence is not None
        assert rotations[-1].event.evidence.new_epoch == before  # no record of the failure
        disk.free()
        # epochs.json may have missed rotations whose record fit; the log lifts it.
        stale = json.loads((data / EPOCHS_FILE).read_text()).get("acme", 0)
        assert stale <= before
        again = governor_on(data)
        try:
            assert again.epochs.get("acme") == before
        finally:
            again.audit.close()
