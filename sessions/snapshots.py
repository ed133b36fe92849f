"""KV snapshot files: one safetensors file per session, written atomically, verified on read."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import save

from engine import KVFile, KVFileDamaged, kv_crc32, read_kv_file
from engine.errors import InvalidRequest

log = logging.getLogger(__name__)

FORMAT = "crowdchat-kv-2"
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What a damaged file makes the header's parser raise (bad JSON: ValueError; JSON nested past
# the decoder's recursion limit, in the header or its fingerprint: RecursionError; a missing
# key: KeyError; a wrong type: TypeError). Anything else is a bug here, not a bad file: it
# propagates so the caller is loud.
DAMAGED_FILE_ERRORS = (OSError, ValueError, RecursionError, KeyError, TypeError, struct.error)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # of K and V


def check_session_id(session_id: str) -> str:
    """`session_id` if it is safe as a file name; raises InvalidRequest otherwise."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise InvalidRequest(
            f"invalid session id {session_id!r}: use 1-64 letters, digits, '_' or '-'"
        )
    return session_id


def token_hash(token_ids: list[int]) -> str:
    """sha256 (hex) of the token ids as little-endian int64."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotFiles:
    """The directory of KV snapshot files. `budget_bytes` (None: unlimited) is enforced by the
    caller against `total_bytes()`. Reads never raise for a bad file: they log and return None;
    an unexpected error (not a bad file) is raised. Thread-safe.
    """

    def __init__(self, directory: Path, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise InvalidRequest(f"snapshot budget must be >= 0 bytes, got {budget_bytes}")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sweep_temp()
        # Each file's size, listed once here, then counted as files are written and deleted:
        # the budget is checked after every write, and a directory walk there grew with the
        # number of snapshots. The lock orders a file's replacement or removal with its count,
        # so the total stays exact under concurrent writers.
        self._lock = threading.Lock()
        self._sizes = {
            p.name[: -len(SUFFIX)]: p.stat().st_size for p in self.directory.glob("*" + SUFFIX)
        }
        self._total = sum(self._sizes.values())

    def path(self, session_id: str) -> Path:
        """Where session `session_id`'s snapshot lives."""
        return self.directory / (check_session_id(session_id) + SUFFIX)

    def write(
        self,
        session_id: str,
        token_ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        fingerprint: dict,
    ) -> tuple[Path, int]:
        """Atomically (re)write the session's snapshot; returns its path and size in bytes."""
        final = self.path(session_id)
        k = k.detach().cpu().contiguous()  # [L, T, H_kv, D]
        v = v.detach().cpu().contiguous()  # [L, T, H_kv, D]
        assert k.ndim == 4 and k.shape == v.shape and k.dtype == v.dtype, (k.shape, v.shape)
        assert k.shape[1] == len(token_ids), (k.shape, len(token_ids))
        tensors = {"k": k, "v": v, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}
        metadata = {
            "format": FORMAT,
            "fingerprint": json.dumps(fingerprint, sort_keys=True),
            "token_hash": token_hash(token_ids),
            "kv_crc32": f"{kv_crc32(k, v):08x}",
        }
        data = save(tensors, metadata=metadata)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{session_id}.", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                os.replace(tmp, final)
                self._count(session_id, len(data))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        return final, len(data)

    def kv_file(
        self,
        session_id: str,
        expected_fingerprint: dict,
        expected_token_hash: str | None = None,
    ) -> KVFile | None:
        """Where the snapshot's K and V lie in its file, with everything but their bytes
        checked (whoever reads those checks them against the CRC-32: `engine.read_kv_file`,
        or the engine's read straight into its pool); None if the file is missing, damaged or
        stale. Raises what a bad file cannot explain (a library or programming error)."""
        path = self.path(session_id)
        kv = None
        try:
            with open(path, "rb") as f:
                header, at = _header(f)
                size = os.fstat(f.fileno()).st_size - at
                metadata = header.get("__metadata__", {})
                # The header alone settles staleness: no need to read the tensors for that.
                reason = _stale(metadata, expected_fingerprint, expected_token_hash)
                if reason is None:
                    spans = [_span(header, name, size) for name in ("token_ids", "k", "v")]
                    reason = _layout(*[span[1:] for span in spans], expected_fingerprint)
                if reason is None:
                    (ids_at, (n,), _), (k_at, shape, dtype), (v_at, _, _) = spans
                    ids = struct.unpack(f"<{n}q", os.pread(f.fileno(), 8 * n, at + ids_at))
                    crc = int(metadata["kv_crc32"], 16)
                    kv = KVFile(list(ids), path, tuple(shape), dtype, at + k_at, at + v_at, crc)
                    if token_hash(kv.token_ids) != metadata["token_hash"]:
                        reason = "stored token ids do not match their hash (corrupted)"
        except FileNotFoundError:
            reason = "missing"
        except DAMAGED_FILE_ERRORS as exc:
            reason = f"unreadable ({type(exc).__name__}: {exc})"
        if reason is not None:
            log.warning("snapshot %s: ignored, %s (%s)", session_id, reason, path)
            return None
        return kv

    def read(
        self,
        session_id: str,
        expected_fingerprint: dict,
        expected_token_hash: str | None = None,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """The snapshot's (token_ids, K, V) in memory, every byte checked, or None if it is
        missing, damaged or stale (as `kv_file`)."""
        kv = self.kv_file(session_id, expected_fingerprint, expected_token_hash)
        if kv is None:
            return None
        try:
            k, v = read_kv_file(kv)
        except KVFileDamaged as exc:
            log.warning("snapshot %s: ignored, %s (%s)", session_id, exc, kv.path)
            return None
        return kv.token_ids, k, v

    def delete(self, session_id: str) -> bool:
        """Remove the session's snapshot file; returns whether there was one."""
        path = self.path(session_id)
        with self._lock:
            self._count(session_id, 0)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
        return True

    def session_ids(self) -> list[str]:
        """The sessions that have a snapshot file here."""
        return sorted(
            p.name[: -len(SUFFIX)]
            for p in self.directory.glob("*" + SUFFIX)
            if _SESSION_ID.fullmatch(p.name[: -len(SUFFIX)])
        )

    def total_bytes(self) -> int:
        """Bytes held by snapshot files in the directory: those found at start-up, then those
        written and deleted here (no directory listing)."""
        with self._lock:
            return self._total

    def _count(self, session_id: str, size: int) -> None:
        """The session's file now holds `size` bytes (0: it is gone); the caller holds `_lock`."""
        self._total += size - self._sizes.pop(session_id, 0)
        if size:
            self._sizes[session_id] = size

    def sweep_temp(self) -> int:
        """Remove temporary files a crash left behind; returns how many."""
        swept = 0
        for p in self.directory.glob("*" + TEMP_SUFFIX):
            p.unlink(missing_ok=True)
            swept += 1
        if swept:
            log.info("removed %d leftover snapshot temp file(s) from %s", swept, self.directory)
        return swept


def _header(f: BinaryIO) -> tuple[dict, int]:
    """A safetensors file's header (a little-endian u64 length, then that many bytes of JSON)
    and where the tensors' bytes start. safetensors parses it too, but tells no file offsets,
    which a read straight into the KV pool needs."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError("no header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {n} bytes")
    raw = f.read(n)
    header = json.loads(raw) if len(raw) == n else None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ValueError("not a safetensors header")
    return header, 8 + n


def _span(header: dict, name: str, size: int) -> tuple[int, list[int], torch.dtype]:
    """Where tensor `name`'s bytes start within the data (`size` bytes), its shape and dtype,
    once its entry is checked to describe bytes inside the data."""
    entry = header[name]
    begin, end = entry["data_offsets"]
    shape, dtype = entry["shape"], {**DTYPES, "I64": torch.int64}.get(entry["dtype"])
    if dtype is None or not all(isinstance(x, int) and x >= 0 for x in shape):
        raise ValueError(f"{name}: {entry['dtype']} {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    if not (isinstance(begin, int) and 0 <= begin and end == begin + nbytes <= size):
        raise ValueError(f"{name}: bytes {begin}..{end} of {size}")
    return begin, shape, dtype


def _stale(metadata: dict[str, str], fingerprint: dict, expected_hash: str | None) -> str | None:
    """Why the header says this snapshot cannot be used here, or None."""
    if metadata.get("format") != FORMAT:
        return f"unknown format {metadata.get('format')!r}"
    if json.loads(metadata["fingerprint"]) != fingerprint:
        return "fingerprint mismatch (another model or KV layout)"
    if expected_hash is not None and metadata["token_hash"] != expected_hash:
        return "token hash mismatch (the conversation changed since the snapshot)"
    return None


def _layout(
    ids: tuple[list[int], torch.dtype], k: tuple[list[int], torch.dtype], v: tuple, fp: dict
) -> str | None:
    """Why the tensors' shapes and dtypes disagree with each other or this model, or None."""
    (id_shape, id_dtype), (k_shape, k_dtype), (v_shape, v_dtype) = ids, k, v
    if id_dtype != torch.int64 or len(id_shape) != 1:
        return f"bad token_ids tensor {id_dtype} {id_shape}"
    if len(k_shape) != 4 or k_shape != v_shape or k_dtype != v_dtype or k_shape[1] != id_shape[0]:
        return f"K {k_shape} / V {v_shape} do not match {id_shape[0]} tokens"
    if id_shape[0] == 0:  # nothing to restore (and torch.frombuffer refuses 0 bytes)
        return "holds no tokens"
    layout = {"num_layers": k_shape[0], "num_kv_heads": k_shape[2], "head_dim": k_shape[3]}
    if any(key in fp and fp[key] != n for key, n in layout.items()):
        return f"K/V shape {k_shape} does not match the fingerprint"
    return None
