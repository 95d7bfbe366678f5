"""DiskTier: full KV blocks in content-addressed files that survive a restart (medium "DISK").

Layout: `<root>/kv-<layout digest>/<block digest hex>.kv`. The layout digest covers the model
file's digest, the KV dtype, block size, layers, KV heads and head dim, so a changed model or
layout never opens an old file (it looks in another directory). Each file is a safetensors
document: the tensor `kv` ([layers, 2, block_size, kv_heads, head_dim]) and a header with the
format tag, the layout digest, the block's digest, its parent's digest, its token ids and the
SHA-256 of the payload. Files are written atomically (temp file in the same directory, fsync,
rename, fsync of the directory), so a crash leaves a whole file or none.

Every read re-verifies everything against what the caller expects (the digest, parent and
token ids it derived from the request's own namespace and tokens): format, layout, digest,
parent, tokens, payload shape, dtype and checksum. Any mismatch — a corrupted, truncated or
swapped file — deletes the file and is a miss (logged, counted in `rejected`); wrong KV is never
returned. At start-up the index is rebuilt from the files' headers (payloads are verified on
restore); unreadable files and stray temp files are deleted.

Trust: the checksum detects corruption, not forgery. Whoever can write this directory can
plant KV for a digest (digests are published in KV events), so it must be as private as the
model file itself (the engine creates it 0700).

Invariants (check_integrity): the index holds exactly the entries whose files were written or
found, their sizes sum to `nbytes`, the child index matches, every entry is one full block.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
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
    return hashlib.sha256(memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
                          ).hexdigest()


class DiskTier:
    medium = MEDIUM_DISK

    def __init__(self, root: Path, layout: KVLayout, capacity_bytes: int) -> None:
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

    # -- write ----------------------------------------------------------------------------

    def write(self, entry: TierEntry, kv: torch.Tensor) -> bool:
        """Store `kv` as the file of `entry` (atomically); False (counted) when the disk
        refuses. The caller made room. Sets `entry.nbytes` to the file's size."""
        kv = kv.contiguous()
        meta = {"format": FILE_FORMAT, "layout": self.layout_digest, "digest": entry.digest.hex(),
                "parent": entry.parent.hex() if entry.parent else "",
                "token_ids": json.dumps(list(entry.token_ids)),
                "payload_sha256": payload_digest(kv)}
        data = save({"kv": kv}, metadata=meta)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=TEMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path_of(entry.digest))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._fsync_directory()
        except OSError as exc:
            self.write_failures += 1
            log.warning("KV block not written to disk: %s", exc)
            return False
        self._unindex(entry.digest)
        entry.nbytes = len(data)
        self._index(entry)
        return True

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- read -----------------------------------------------------------------------------

    def read(self, digest: bytes, parent: bytes | None,
             token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The KV of block `digest`, verified against the expected parent and tokens and the
        file's own checksum; None (file deleted, counted) on any mismatch or read error."""
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
        self._unindex(digest)
        self._unlink(self.path_of(digest), reason)

    # -- removal --------------------------------------------------------------------------

    def remove(self, digest: bytes) -> str | None:
        """Delete the block's file; None when it is gone, else why it could not be."""
        self._unindex(digest)
        try:
            self.path_of(digest).unlink(missing_ok=True)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def clear(self) -> tuple[list[TierEntry], list[str]]:
        """Delete every file in the directory; (entries dropped, errors)."""
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
        assert self.nbytes == sum(e.nbytes for e in self._entries.values()), "bytes drifted"
        for digest, entry in self._entries.items():
            assert entry.digest == digest
            entry.check(self.layout.block_size)
        self.children.check(self._entries.values())
