"""DiskTier: full KV blocks in content-addressed files that survive a restart (medium "DISK").

Layout: `<root>/kv-<layout digest>/<block digest hex>.kv`. The layout digest covers the model
file's digest, the KV dtype, block size, layers, KV heads and head dim, so a changed model or
layout never opens an old file (it looks in another directory). Each file is a safetensors
document: the tensor `kv` ([layers, 2, block_size, kv_heads, head_dim]) and a header with the
format tag, the layout digest, the block's digest, its parent's digest, its token ids and the
SHA-256 of the payload. Files are written atomically (temp file in the same directory, fsync,
rename, fsync of the directory), so a crash leaves a whole file or none. Writes happen on a
writer thread behind the engine (fsync is milliseconds a block): a demoted block is indexed at
once and served from the write queue until its file is durable; removing it cancels or awaits
its write, so no file of a removed block can appear afterwards. A full queue drops new blocks
(counted) instead of stalling the engine.

Every read re-verifies everything against what the caller expects (the digest, parent and
token ids it derived from the request's own namespace and tokens): format, layout, digest,
parent, tokens, payload shape, dtype and checksum. Any mismatch — a corrupted, truncated or
swapped file — deletes the file and is a miss (logged, counted in `rejected`); wrong KV is never
returned. At start-up the index is rebuilt from the files' headers (payloads are verified on
restore); unreadable files and stray temp files are deleted.

Trust: the checksum detects corruption, not forgery. Whoever can write this directory can
plant KV for a digest (digests are published in KV events), so it must be as private as the
model file itself (the engine creates it 0700).

Invariants (check_integrity): the index holds the entries whose files were found, written or
queued (less failed writes not yet reaped), their sizes sum to `nbytes`, every queued block is
indexed, the child index matches, every entry is one full block.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from native_engine.kvcache.tier_entry import MEDIUM_DISK, ChildIndex, TierEntry

log = logging.getLogger(__name__)

FILE_FORMAT = "fak-kv-block-1"
SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
HEADER_ALLOWANCE = 4096  # a file's safetensors header, counted on top of its KV bytes
MAX_PENDING = 256  # blocks queued for the writer thread before new ones are dropped
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What makes a stored KV block valid for this engine: the model and the KV shape."""

    model_digest: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {tuple(KV_DTYPES)}, got {self.dtype!r}")
        if not self.model_digest:
            raise ValueError("the KV layout needs the model's digest")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.finfo(self.torch_dtype).bits // 8

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def payload_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()


class DiskTier:
    medium = MEDIUM_DISK

    def __init__(self, root: Path, layout: KVLayout, capacity_bytes: int,
                 max_pending: int = MAX_PENDING) -> None:
        if capacity_bytes < layout.block_bytes:
            raise ValueError("the disk tier needs room for at least one block")
        self.layout = layout
        self.layout_digest = layout.digest()
        self.capacity_bytes = capacity_bytes
        self.directory = Path(root) / f"kv-{self.layout_digest}"
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._entries: dict[bytes, TierEntry] = {}
        self.children = ChildIndex()
        self.nbytes = 0
        self.rejected = 0
        self.write_failures = 0
        self.backlog_drops = 0
        self.max_pending = max_pending
        # Writer-thread state, under _lock; the index above is the engine thread's alone.
        self._lock = threading.Condition()
        self._pending: dict[bytes, tuple[bytes | None, tuple[int, ...], torch.Tensor]] = {}
        self._queue: deque[bytes] = deque()
        self._writing: bytes | None = None
        self._failed: list[bytes] = []
        self._writer: threading.Thread | None = None
        self._closing = False
        self.found_at_start = self._rebuild_index()

    # -- index ----------------------------------------------------------------------------

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> TierEntry | None:
        return self._entries.get(digest)

    def entries(self) -> list[TierEntry]:
        return list(self._entries.values())

    def path_of(self, digest: bytes) -> Path:
        return self.directory / (digest.hex() + SUFFIX)

    def _index(self, entry: TierEntry) -> None:
        self._entries[entry.digest] = entry
        self.children.add(entry)
        self.nbytes += entry.nbytes

    def _unindex(self, digest: bytes) -> TierEntry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self.children.discard(entry)
            self.nbytes -= entry.nbytes
        return entry

    def _rebuild_index(self) -> list[TierEntry]:
        """Index every valid file (oldest first, so LRU resumes); delete the rest."""
        files = []
        for path in self.directory.iterdir():
            if path.name.startswith(TEMP_PREFIX) or path.suffix != SUFFIX:
                self._unlink(path, "stray file")
                continue
            try:
                files.append((path.stat().st_mtime_ns, path))
            except OSError:
                continue
        found = []
        for tick, (_, path) in enumerate(sorted(files)):
            entry = self._read_header(path)
            if entry is None:
                self.rejected += 1
                self._unlink(path, "unreadable header at start-up")
                continue
            entry.last_use = -len(files) + tick  # older than anything used from now on
            self._index(entry)
            found.append(entry)
        return found

    def _read_header(self, path: Path) -> TierEntry | None:
        try:
            digest = bytes.fromhex(path.stem)
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            size = path.stat().st_size
            parent = bytes.fromhex(meta["parent"]) if meta["parent"] else None
            tokens = tuple(int(t) for t in json.loads(meta["token_ids"]))
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            log.warning("KV file %s unreadable: %s", path.name, exc)
            return None
        ok = (meta.get("format") == FILE_FORMAT and meta.get("layout") == self.layout_digest
              and meta.get("digest") == digest.hex() and len(digest) == 32
              and len(tokens) == self.layout.block_size and parent != digest)
        if not ok:
            log.warning("KV file %s: header does not match its name or layout", path.name)
            return None
        return TierEntry(digest, parent, tokens, None, False, size)

    # -- write (behind the engine thread) -------------------------------------------------

    def write(self, entry: TierEntry, kv: torch.Tensor) -> bool:
        """Queue `kv` to be written as the file of `entry` by the writer thread; the block is
        indexed (and readable from the queue) at once. False (counted) when the queue is full:
        the block is then dropped rather than stalling the engine. The caller made room;
        each block counts as its KV bytes plus `HEADER_ALLOWANCE`."""
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.backlog_drops += 1
                return False
            self._pending[entry.digest] = (entry.parent, entry.token_ids, kv.clone())
            if self._closing:
                return False
            self._queue.append(entry.digest)
            self._lock.notify_all()
            self._start_writer()
        self._unindex(entry.digest)
        entry.nbytes = self.layout.block_bytes + HEADER_ALLOWANCE
        self._index(entry)
        return True

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                            daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue:
                    return
                digest = self._queue.popleft()
                job = self._pending.get(digest)
                if job is None:  # removed before it was written; drain() may wait on it
                    self._lock.notify_all()
                    continue
                self._writing = digest
            error = self._write_file(digest, *job)
            with self._lock:
                self._writing = None
                if self._pending.pop(digest, None) is None:  # removed while being written
                    self._unlink(self.path_of(digest), "removed while written")
                elif error:
                    self.write_failures += 1
                    self._failed.append(digest)
                    log.warning("KV block not written to disk: %s", error)
                self._lock.notify_all()

    def _write_file(self, digest: bytes, parent: bytes | None, token_ids: tuple[int, ...],
                    kv: torch.Tensor) -> str | None:
        """Temp file, fsync, rename, fsync of the directory; an error's text, or None."""
        kv = kv.contiguous()
        meta = {"format": FILE_FORMAT, "layout": self.layout_digest, "digest": digest.hex(),
                "parent": parent.hex() if parent else "",
                "token_ids": json.dumps(list(token_ids)), "payload_sha256": payload_digest(kv)}
        data = save({"kv": kv}, metadata=meta)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=TEMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path_of(digest))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._fsync_directory()
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def reap(self) -> list[bytes]:
        """Unindex blocks whose write failed; returns their digests (engine thread)."""
        with self._lock:
            failed, self._failed = self._failed, []
        for digest in failed:
            self._unindex(digest)
        return failed

    def drain(self) -> None:
        """Wait until every queued block is on disk (or failed)."""
        with self._lock:
            while self._queue or self._writing is not None:
                self._lock.wait()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- read -----------------------------------------------------------------------------

    def read(self, digest: bytes, parent: bytes | None,
             token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The KV of block `digest`, verified against the expected parent and tokens and the
        file's own checksum; None (file deleted, counted) on any mismatch or read error. A
        block still queued for writing is served from the queue (same checks but the file's)."""
        with self._lock:
            job = self._pending.get(digest)
        if job is not None:
            if job[0] == parent and job[1] == token_ids:
                return job[2]
            self._reject(digest, "queued block differs")
            return None
        path = self.path_of(digest)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                kv = f.get_tensor("kv")
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            self._reject(digest, f"unreadable ({exc})")
            return None
        problem = self._mismatch(meta, kv, digest, parent, token_ids)
        if problem:
            self._reject(digest, problem)
            return None
        return kv

    def _mismatch(self, meta: dict[str, str], kv: torch.Tensor, digest: bytes,
                  parent: bytes | None, token_ids: tuple[int, ...]) -> str | None:
        if meta.get("format") != FILE_FORMAT or meta.get("layout") != self.layout_digest:
            return "format or layout"
        if meta.get("digest") != digest.hex():
            return "digest"
        if meta.get("parent") != (parent.hex() if parent else ""):
            return "parent digest"
        try:
            if tuple(json.loads(meta.get("token_ids", "null"))) != token_ids:
                return "token ids"
        except (ValueError, TypeError):
            return "token ids"
        if tuple(kv.shape) != self.layout.block_shape or kv.dtype != self.layout.torch_dtype:
            return "payload shape or dtype"
        if meta.get("payload_sha256") != payload_digest(kv):
            return "payload checksum"
        return None

    def _reject(self, digest: bytes, reason: str) -> None:
        self.rejected += 1
        log.warning("KV file %s rejected (%s): deleted, served as a miss", digest.hex()[:16],
                    reason)
        self.remove(digest)

    # -- removal --------------------------------------------------------------------------

    def remove(self, digest: bytes) -> str | None:
        """Delete the block's file (a queued write is cancelled, one in progress awaited);
        None when it is gone, else why it could not be. A file that cannot be deleted stays
        indexed, so the failure stays visible to the next removal (and a flush)."""
        entry = self._unindex(digest)
        with self._lock:
            self._pending.pop(digest, None)
            while self._writing == digest:
                self._lock.wait()
        error = self._unlink(self.path_of(digest), "removal")
        if error and entry is not None:
            self._index(entry)
        return error

    def clear(self) -> tuple[list[TierEntry], list[str]]:
        """Delete every file in the directory; (entries dropped, errors)."""
        self.reap()
        gone = list(self._entries.values())
        errors = [e for e in (self.remove(entry.digest) for entry in gone) if e]
        try:
            for path in self.directory.iterdir():
                error = self._unlink(path, "flush")
                if error:
                    errors.append(error)
        except OSError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        return gone, errors

    def _unlink(self, path: Path, why: str) -> str | None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("cannot delete KV file %s (%s): %s", path.name, why, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def check_integrity(self) -> None:
        with self._lock:
            queued, failed = set(self._pending), set(self._failed)
        assert queued <= self._entries.keys() | failed, "a queued block is not indexed"
        assert self.nbytes == sum(e.nbytes for e in self._entries.values()), "bytes drifted"
        for digest, entry in self._entries.items():
            assert entry.digest == digest
            entry.check(self.layout.block_size)
        self.children.check(self._entries.values())
