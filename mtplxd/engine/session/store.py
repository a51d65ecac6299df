"""The session bank's SSD tier: entries survive a daemon restart.

Layout under the bank directory (`$MTPLX_HOME/session-bank/`):
- `blobs/<2 hex>/<sha256>.safetensors`: one content-addressed blob per entry (the file's own
  sha256 is its name), in the safetensors format (readable by `mx.load` too). No pickle.
- `manifest.sqlite`: one row per blob: identity key, token ids (int32 little-endian), the
  restore facts (length, head_len, tail rows, hybrid boundaries), size and timestamps.

Writes happen off the request path: `put` (owner thread) only takes host views of the
entry's evaluated arrays (no copy: MLX arrays are immutable, so the views read the very bytes
the RAM entry holds, and keep them alive until written) and queues them; a writer thread, at
a low CPU priority where the OS allows it, hashes the file's bytes straight from those views,
writes them to a temp name, fsyncs, renames, and records it in the manifest. Nothing of that
runs on the model thread, so the next request is admitted while the blob is still being
written. A queue backlog budget drops writes rather than letting memory grow (a queued entry
that the RAM tier evicts meanwhile stays in memory until its write is done). The store is
capped by bytes and by free disk (never more than half of what is free when it writes); the
least recently used blobs go first, and a new entry supersedes stored entries of the same
identity whose tokens it extends.

Reads verify the sha256 of the whole blob before decoding it: a corrupt or truncated blob
is deleted with its manifest row and never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import sqlite3
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtplxd.engine.session.types import (
    GDN, KV, QKV, BankEntry, RestorePlan, common_prefix, plan_restore,
)

log = logging.getLogger(__name__)

DEFAULT_BACKLOG_BYTES = 4 * 1024**3
# Lookups only read rows whose first LEAD_TOKENS token ids equal the prompt's: a shorter
# shared prefix is not worth a disk read.
LEAD_TOKENS = 64
SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    sha256 TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    length INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    lead TEXT NOT NULL,
    head_len INTEGER NOT NULL,
    tail_rows INTEGER NOT NULL,
    has_head INTEGER NOT NULL,
    boundaries TEXT,
    kinds TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_lead ON entries(identity, lead);
"""

# safetensors dtype names <-> MLX dtypes; 2-byte floats travel as uint16 through numpy.
_ST_DTYPES = {
    mx.float32: ("F32", np.float32), mx.float16: ("F16", np.uint16),
    mx.bfloat16: ("BF16", np.uint16), mx.int32: ("I32", np.int32),
    mx.uint32: ("U32", np.uint32), mx.int64: ("I64", np.int64), mx.uint8: ("U8", np.uint8),
}
_FROM_ST = {name: (dtype, np_dtype) for dtype, (name, np_dtype) in _ST_DTYPES.items()}


# How much lower than the daemon's the writer thread's CPU priority is (Linux: a thread's
# own nice value). Hashing and writing a long conversation takes seconds of CPU; on a machine
# with few cores it must not take them from the model thread's next prefill.
WRITER_NICENESS = 10

# A tensor on its way to disk: (name, safetensors dtype, shape, host view), the view a numpy
# array reading an evaluated MLX array's memory.
HostTensor = tuple[str, str, tuple[int, ...], np.ndarray]


@dataclass
class _Pending:
    """An entry's tensors as host views, waiting for the writer thread."""

    identity: str
    meta: dict[str, Any]
    tensors: list[HostTensor]
    nbytes: int = 0  # what `put` counted against the backlog


def lead_hash(tokens: Any) -> str:
    """sha256 of the first LEAD_TOKENS token ids (int32 little-endian)."""
    return hashlib.sha256(np.asarray(tokens[:LEAD_TOKENS], dtype="<i4").tobytes()).hexdigest()


# --- codec -------------------------------------------------------------------------------


def host_view(name: str, array: mx.array) -> HostTensor:
    """(name, safetensors dtype, shape, numpy view) of `array`, without copying its data
    (2-byte floats are viewed as uint16, numpy having no bfloat16). Owner thread: the array
    is evaluated here if it is not yet; the view may then be read from any thread."""
    st_name, np_dtype = _ST_DTYPES[array.dtype]
    host = np.asarray(array.view(mx.uint16) if np_dtype is np.uint16 else array)
    return name, st_name, tuple(array.shape), host


def _raw(host: np.ndarray) -> memoryview:
    """The little-endian bytes of a tensor's data in C order, as a flat memoryview (no copy
    for a C-contiguous little-endian array, the usual case)."""
    host = np.ascontiguousarray(host)
    host = host.astype(host.dtype.newbyteorder("<"), copy=False)
    return memoryview(host).cast("B")


def _safetensors_header(tensors: list[HostTensor], metadata: dict[str, str]) -> bytes:
    """The bytes before the tensors' data in a safetensors file: u64 header length, JSON."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, host in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + host.nbytes]}
        offset += host.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(head)) + head


def safetensors_pieces(tensors: list[HostTensor], metadata: dict[str, str]) -> list[memoryview]:
    """A safetensors file as its pieces, in order: the header (u64 length, JSON), then each
    tensor's bytes, read from the host views uncopied."""
    return [memoryview(_safetensors_header(tensors, metadata))] + [_raw(t[3]) for t in tensors]


def encode_safetensors(tensors: list[HostTensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file's bytes (its pieces joined)."""
    return b"".join(safetensors_pieces(tensors, metadata))


def decode_safetensors(data: bytes) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Arrays and metadata of a safetensors file's bytes (raises ValueError when malformed)."""
    if len(data) < 8:
        raise ValueError("truncated safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if 8 + size > len(data):
        raise ValueError("truncated safetensors header")
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", {})
    body = memoryview(data)[8 + size:]
    arrays = {}
    for name, spec in header.items():
        dtype, np_dtype = _FROM_ST[spec["dtype"]]
        start, end = spec["data_offsets"]
        if end > len(body):
            raise ValueError(f"tensor {name} runs past the end of the file")
        host = np.frombuffer(body[start:end], dtype=np.dtype(np_dtype).newbyteorder("<"))
        array = mx.array(host.reshape(spec["shape"]))
        arrays[name] = array.view(dtype) if np_dtype is np.uint16 else array
    return arrays, metadata


def _tensor_names(entry: BankEntry) -> list[tuple[str, mx.array]]:
    named: list[tuple[str, mx.array]] = []
    for i, (pair, kind) in enumerate(zip(entry.kv, entry.kinds)):
        if kind == KV:
            named += [(f"kv.{i}.k", pair[0]), (f"kv.{i}.v", pair[1])]
        elif kind == QKV:
            named += [(f"kv.{i}.{side}.{j}", a) for side, arrays in zip("kv", pair) for j, a in enumerate(arrays)]
    for b, state in entry.boundaries.items():
        for j, (conv, rec) in enumerate(state):
            if conv is not None:
                named.append((f"gdn.{b}.{j}.conv", conv))
            if rec is not None:
                named.append((f"gdn.{b}.{j}.rec", rec))
    if entry.head_kv is not None:
        named += [("head.k", entry.head_kv[0]), ("head.v", entry.head_kv[1])]
    if entry.tail_hidden is not None:
        named.append(("tail", entry.tail_hidden))
    return named


def entry_from_arrays(arrays: dict[str, mx.array], meta: dict[str, Any],
                      tokens: tuple[int, ...]) -> BankEntry:
    """Rebuild a BankEntry from decoded arrays and the manifest facts."""
    kinds = tuple(meta["kinds"])
    kv: list = []
    for i, kind in enumerate(kinds):
        if kind == KV:
            kv.append((arrays[f"kv.{i}.k"], arrays[f"kv.{i}.v"]))
        elif kind == QKV:
            kv.append(tuple(tuple(arrays[f"kv.{i}.{side}.{j}"] for j in range(3)) for side in "kv"))
        else:
            kv.append(None)
    n_gdn = sum(1 for k in kinds if k == GDN)
    boundaries = {}
    for b in meta.get("boundaries") or []:
        boundaries[b] = [(arrays.get(f"gdn.{b}.{j}.conv"), arrays.get(f"gdn.{b}.{j}.rec"))
                         for j in range(n_gdn)]
    head_kv = (arrays["head.k"], arrays["head.v"]) if "head.k" in arrays else None
    entry = BankEntry(tokens=tokens, kinds=kinds, kv=kv, boundaries=boundaries,
                      head_kv=head_kv, head_len=int(meta["head_len"]),
                      tail_hidden=arrays.get("tail"))
    entry.compute_nbytes()
    return entry


# --- the store ---------------------------------------------------------------------------


def _connect_manifest(path: Path) -> sqlite3.Connection:
    """Open the manifest, create its schema and run SQLite's quick integrity check; raises
    sqlite3.DatabaseError (connection closed) when the file is damaged."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {verdict}")
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


class SessionStore:
    """Content-addressed entry blobs + a SQLite manifest (see the module docstring)."""

    def __init__(self, root: Path, *, max_bytes: int,
                 backlog_bytes: int = DEFAULT_BACKLOG_BYTES) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.max_bytes = max_bytes
        self.backlog_bytes = backlog_bytes
        # Set when a damaged store was moved aside at open: {"path", "reason", "at"}.
        self.quarantined: dict[str, Any] | None = None
        self._db = self._open_manifest()
        self._db_lock = threading.Lock()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._backlog = 0
        self._backlog_lock = threading.Lock()
        self.written = 0
        self.dropped_backlog = 0
        self.corrupt_dropped = 0
        self.write_errors = 0
        self._remove_temp_files()
        self._writer = threading.Thread(target=self._write_loop, name="mtplx-session-ssd",
                                        daemon=True)
        self._writer.start()

    def _open_manifest(self) -> sqlite3.Connection:
        """The manifest, checked at open. A damaged store is moved aside and an empty one
        begun: the bank is a cache, and a cache must never keep the daemon from serving."""
        try:
            return _connect_manifest(self.root / "manifest.sqlite")
        except sqlite3.DatabaseError as exc:
            self.quarantined = self._quarantine(str(exc))
            return _connect_manifest(self.root / "manifest.sqlite")

    def _quarantine(self, reason: str) -> dict[str, Any]:
        """Rename the whole store (manifest, its WAL, blobs) to `<dir>.damaged`, replacing an
        older one, and start an empty store in its place."""
        aside = self.root.with_name(self.root.name + ".damaged")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(self.root, aside)
        self.blobs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        log.warning("session bank: the SSD store was damaged (%s); moved aside to %s and "
                    "started empty", reason, aside)
        return {"path": str(aside), "reason": reason, "at": time.time()}

    # -- owner thread ---------------------------------------------------------------------

    def put(self, identity: str, entry: BankEntry) -> bool:
        """Queue `entry` for writing (copies its arrays to host bytes now); returns False when
        the writer's backlog is full and the entry is skipped."""
        if entry.nbytes > self.max_bytes:
            return False
        with self._backlog_lock:
            if self._backlog + entry.nbytes > self.backlog_bytes and self._backlog > 0:
                self.dropped_backlog += 1
                return False
            self._backlog += entry.nbytes
        meta = {
            "length": entry.length, "head_len": entry.head_len,
            "tail_rows": int(entry.tail_hidden.shape[1]) if entry.tail_hidden is not None else 0,
            "has_head": entry.head_kv is not None,
            "boundaries": sorted(entry.boundaries) if entry.hybrid else None,
            "kinds": list(entry.kinds), "session_id": entry.session_id,
            "rope_delta": entry.rope_delta,
            "tokens": np.asarray(entry.tokens, dtype="<i4").tobytes(),
        }
        tensors = [host_view(name, array) for name, array in _tensor_names(entry)]
        self._queue.put(_Pending(identity, meta, tensors, entry.nbytes))
        return True

    def best_match(self, identity: str, prompt: list[int], need_head: bool,
                   better_than: int) -> dict[str, Any] | None:
        """The manifest row whose restore plan for `prompt` is deepest and deeper than
        `better_than` tokens, or None."""
        if len(prompt) <= LEAD_TOKENS:
            return None
        with self._db_lock:
            rows = self._db.execute(
                "SELECT sha256, length, tokens, head_len, tail_rows, has_head, boundaries, kinds "
                "FROM entries WHERE identity = ? AND lead = ? AND length > ?",
                (identity, lead_hash(prompt), better_than)).fetchall()
        best: tuple[int, dict[str, Any]] | None = None
        for sha, length, tokens, head_len, tail_rows, has_head, boundaries, kinds in rows:
            if need_head and not has_head:
                continue
            ids = np.frombuffer(tokens, dtype="<i4")
            plan: RestorePlan | None = plan_restore(
                length, json.loads(boundaries) if boundaries else None, head_len, tail_rows,
                common_prefix(ids, prompt), len(prompt), need_head)
            if plan is not None and plan.trunk_len > better_than \
                    and (best is None or plan.trunk_len > best[0]):
                best = (plan.trunk_len, {
                    "sha256": sha, "tokens": tuple(int(t) for t in ids), "head_len": head_len,
                    "boundaries": json.loads(boundaries) if boundaries else None,
                    "kinds": json.loads(kinds)})
        return best[1] if best else None

    def load(self, row: dict[str, Any], kinds: tuple[str, ...]) -> BankEntry | None:
        """Read and verify a blob; None (and the row and blob deleted) when it is missing,
        corrupt, truncated or does not fit this model's layer layout."""
        sha = row["sha256"]
        path = self._blob_path(sha)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(sha, corrupt=True)
            return None
        if hashlib.sha256(data).hexdigest() != sha or tuple(row["kinds"]) != tuple(kinds):
            log.warning("session bank: blob %s failed its check; dropped", sha[:12])
            self._forget(sha, corrupt=True)
            return None
        try:
            arrays, header = decode_safetensors(data)
            entry = entry_from_arrays(arrays, row, row["tokens"])
            entry.rope_delta = int(header.get("rope_delta", 0))
        except (ValueError, KeyError) as exc:
            log.warning("session bank: blob %s unreadable (%s); dropped", sha[:12], exc)
            self._forget(sha, corrupt=True)
            return None
        with self._db_lock:
            self._db.execute("UPDATE entries SET last_used = ? WHERE sha256 = ?",
                             (time.time(), sha))
        return entry

    def stats(self) -> dict[str, Any]:
        """enabled, entries, bytes, cap, queued writes, written, dropped and corrupt counts."""
        with self._db_lock:
            count, total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM entries").fetchone()
        return {"enabled": True, "entries": count, "bytes": total, "cap_bytes": self.max_bytes,
                "queued": self._queue.qsize(), "written": self.written,
                "dropped_backlog": self.dropped_backlog, "corrupt_dropped": self.corrupt_dropped,
                "write_errors": self.write_errors, "dir": str(self.root),
                "quarantined": self.quarantined}

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (bounded by `timeout`) and stop the writer."""
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)
        with self._db_lock:
            self._db.close()

    # -- writer thread --------------------------------------------------------------------

    def _write_loop(self) -> None:
        _lower_thread_priority(WRITER_NICENESS)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:
                self.write_errors += 1
                log.exception("session bank: SSD write failed")
            finally:
                if item is not None:
                    with self._backlog_lock:
                        self._backlog -= item.nbytes
                self._queue.task_done()

    def _write(self, item: _Pending) -> None:
        # rope_delta (mRoPE, prompts with images) rides in the blob's header: the manifest
        # only needs what picks a match.
        # Hashed and written piece by piece, from the host views: no copy of the entry's data.
        pieces = safetensors_pieces(item.tensors, {"format": "mtplx-session-bank/1",
                                                   "rope_delta": str(item.meta.get("rope_delta", 0))})
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        sha = digest.hexdigest()
        size = sum(piece.nbytes for piece in pieces)
        path = self._blob_path(sha)
        if not path.exists():
            self._make_room(size)
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_suffix(".tmp")
            with open(temp, "wb") as f:
                for piece in pieces:
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        del pieces
        m = item.meta
        now = time.time()
        with self._db_lock:
            self._db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (sha, item.identity, m["length"], m["tokens"],
                 lead_hash(np.frombuffer(m["tokens"], dtype="<i4")), m["head_len"], m["tail_rows"],
                 int(m["has_head"]), json.dumps(m["boundaries"]) if m["boundaries"] else None,
                 json.dumps(m["kinds"]), size, m["session_id"], now, now))
        self.written += 1
        self._supersede(sha, item)

    def _supersede(self, sha: str, item: _Pending) -> None:
        """Drop stored entries of the same identity whose tokens the new entry extends."""
        new = np.frombuffer(item.meta["tokens"], dtype="<i4")
        with self._db_lock:
            rows = self._db.execute(
                "SELECT sha256, tokens, has_head FROM entries WHERE identity = ? AND length < ?",
                (item.identity, item.meta["length"])).fetchall()
        for other, tokens, has_head in rows:
            ids = np.frombuffer(tokens, dtype="<i4")
            if other != sha and np.array_equal(new[:len(ids)], ids) \
                    and (item.meta["has_head"] or not has_head):
                self._forget(other)

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used blobs until `incoming` fits the byte cap and half the
        free disk."""
        free = shutil.disk_usage(self.root).free
        while True:
            with self._db_lock:
                used = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0]
                oldest = self._db.execute(
                    "SELECT sha256, bytes FROM entries ORDER BY last_used LIMIT 1").fetchone()
            cap = min(self.max_bytes, used + free // 2)
            if used + incoming <= cap or oldest is None:
                return
            self._forget(oldest[0])
            free += oldest[1]

    def _forget(self, sha: str, corrupt: bool = False) -> None:
        with self._db_lock:
            self._db.execute("DELETE FROM entries WHERE sha256 = ?", (sha,))
        if corrupt:
            self.corrupt_dropped += 1
        self._blob_path(sha).unlink(missing_ok=True)

    def _blob_path(self, sha: str) -> Path:
        return self.blobs / sha[:2] / f"{sha}.safetensors"

    def _remove_temp_files(self) -> None:
        for temp in self.blobs.glob("*/*.tmp"):
            temp.unlink(missing_ok=True)


def _lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value by `niceness` where threads have their own
    (Linux); elsewhere nothing changes. Never fails: the priority is only a courtesy."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(current + niceness, 19))
    except (AttributeError, OSError):
        pass
