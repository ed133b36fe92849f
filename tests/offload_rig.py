"""The KV offloader over a fake engine (no model), a real SQLite store and real snapshot files,
for the offload tests; the `rig` fixture (one such offloader a test) is in tests/conftest.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import KVExport, KVFile, read_kv_file
from sessions.offload import KVOffloader
from sessions.snapshots import SnapshotFiles
from sessions.store import Store

FP = {"model_id": "fake", "block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}


class FakeEngine:
    """The engine calls the offloader makes, on a dict of resident KV."""

    def __init__(self) -> None:
        self.kv_fingerprint = FP
        self.device_type = "cpu"
        self.resident: dict[str, KVExport] = {}
        self.exports = 0
        self.imports_from_file = 0
        # what the engine's step timer and snapshot reads would have measured (None: nothing)
        self.recompute_s_per_token: float | None = None
        self.read_s_per_byte: float | None = None

    def export_kv(self, sid: str) -> KVExport | None:
        self.exports += 1
        return self.resident.get(sid)

    def drop_kv(self, sid: str) -> bool:
        return self.resident.pop(sid, None) is not None

    def import_kv(
        self, sid: str, kv: KVExport, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        self.resident[sid] = kv
        return True

    def import_kv_file(
        self, sid: str, kv: KVFile, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        self.imports_from_file += 1
        return self.import_kv(sid, KVExport(kv.token_ids, *read_kv_file(kv)))

    def recompute_s(self, tokens: int) -> float | None:
        pace = self.recompute_s_per_token
        return None if pace is None else pace * tokens

    def read_s(self, nbytes: int) -> float | None:
        return None if self.read_s_per_byte is None else self.read_s_per_byte * nbytes

    def resident_kv(self) -> dict[str, tuple[int, int, float]]:
        return {s: (len(kv.token_ids), 1, 999.0) for s, kv in list(self.resident.items())}


def fake_kv(tokens: int = 5, seed: int = 0) -> KVExport:
    gen = torch.Generator().manual_seed(seed)
    shape = (FP["num_layers"], tokens, FP["num_kv_heads"], FP["head_dim"])  # [L, T, H, D]
    return KVExport(
        list(range(1, tokens + 1)),
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen),
    )


class Rig:
    """A KV offloader over a fake engine, recording the state it last reported per session."""

    def __init__(self, tmp: Path, disk_budget: int = 1 << 30) -> None:
        self.engine = FakeEngine()
        self.store = Store(tmp / "crowdchat.db")
        self.files = SnapshotFiles(tmp / "snapshots")
        self.states: dict[str, str] = {}
        self.off = KVOffloader(
            self.engine,  # type: ignore[arg-type]
            self.store,
            self.files,
            0,
            disk_budget,
            self.states.__setitem__,
        )

    def session(self, sid: str, resident: bool = True, tokens: int = 5, seed: int = 0) -> str:
        self.store.create_session(sid, "u", "", "")
        if resident:
            self.engine.resident[sid] = fake_kv(tokens, seed)
        return sid

    def evict(self, sid: str) -> None:
        self.off.evict(1, None, lambda other: other != sid)

    def close(self) -> None:
        self.off.flush()
        self.store.close()


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
