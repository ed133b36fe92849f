"""KV outside the pool: copied to host memory (`KVExport`), or stored raw in a file (a session
snapshot, `KVFile`): where its bytes are, and how to check them.

The session layer owns the file format (sessions/snapshots.py); the engine needs only where K
and V lie in the file and the CRC-32 they must have, to read them straight into its pool.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class KVExport:
    """An owner's resident KV copied to CPU: the token ids it covers, K and V `[L, T, H_kv, D]`."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor


class KVFileDamaged(Exception):
    """The file's K/V bytes are unreadable or do not match their CRC-32."""


@dataclass(frozen=True)
class KVFile:
    """An owner's KV in a file: the token ids it covers; K and V, each of `shape`
    (`[L, T, H_kv, D]`) and `dtype`, raw (little-endian, contiguous) at byte offsets `k_at`
    and `v_at` of `path`; the CRC-32 of K's bytes then V's (`kv_crc32`)."""

    token_ids: list[int]
    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    k_at: int
    v_at: int
    crc32: int


def _crc32_kernel() -> Callable[[torch.Tensor, int], int] | None:
    """crowdchat's CRC-32 op where engine.kernels has loaded it (this top level of engine/
    imports no sub-package), else None."""
    return getattr(torch.ops.crowdchat, "crc32_bytes", None)  # a missing op: AttributeError


def kv_crc32(k: torch.Tensor, v: torch.Tensor) -> int:
    """zlib's CRC-32 of K's raw bytes, then V's (a checksum against torn or flipped bytes, not
    a cryptographic hash): on crowdchat's CPU kernel where it is built (csrc/crc32.h, folded
    with PCLMULQDQ: 46 MB in ~5 ms against zlib's ~21 on a Sapphire Rapids-class Xeon), else
    zlib's; the same values."""
    op = _crc32_kernel()
    crc = 0
    for t in (k, v):
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        crc = op(flat, crc) if op is not None else zlib.crc32(flat.numpy(), crc)
    return crc


def check_crc32(kv: KVFile, crc: int) -> None:
    """Raises KVFileDamaged unless `crc`, computed over the bytes read, is the file's."""
    if crc != kv.crc32:
        raise KVFileDamaged("K/V data do not match their hash (corrupted)")


def kv_file_bytes(kv: KVFile) -> int:
    """The bytes of K and V a read of the file moves."""
    return 2 * math.prod(kv.shape) * kv.dtype.itemsize


def read_kv_file(kv: KVFile) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V read from the file into memory, checked against the CRC-32. Raises
    KVFileDamaged for a short, unreadable or corrupted file."""
    nbytes = math.prod(kv.shape) * kv.dtype.itemsize
    try:
        with open(kv.path, "rb") as f:
            parts = [os.pread(f.fileno(), nbytes, at) for at in (kv.k_at, kv.v_at)]
    except OSError as e:
        raise KVFileDamaged(f"unreadable ({type(e).__name__}: {e})") from e
    if any(len(p) != nbytes for p in parts):
        raise KVFileDamaged("shorter than its K/V")
    check_crc32(kv, zlib.crc32(parts[1], zlib.crc32(parts[0])))
    k, v = (torch.frombuffer(bytearray(p), dtype=kv.dtype).view(kv.shape) for p in parts)
    return k, v


class ReadPace:
    """How fast snapshots are read into the pool: seconds a byte, a moving average over the
    reads so far (only the reading: not the waits for the engine thread around it)."""

    WEIGHT = 0.3  # the newest read's weight

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.s_per_byte: float | None = None

    def add(self, nbytes: int, seconds: float) -> None:
        pace = seconds / max(nbytes, 1)
        with self._lock:
            old = self.s_per_byte
            self.s_per_byte = pace if old is None else old + self.WEIGHT * (pace - old)

    def seconds(self, nbytes: int) -> float | None:
        """Seconds a read of `nbytes` takes at this pace (None before the first read)."""
        pace = self.s_per_byte
        return None if pace is None else pace * nbytes
