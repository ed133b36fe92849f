"""KV in and out of the pool for the session layer: export, import (also from a file), drop.

A mixin of `Engine` (engine.core.engine): each call runs its pool work on the engine thread
through `_call`; a file's bytes are read on the caller's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from engine.core.scheduler import Scheduler
from engine.errors import InvalidRequest
from engine.kv_file import KVExport, KVFile, ReadPace, kv_file_bytes, read_kv_file
from engine.model.kv_cache import KVCache

T = TypeVar("T")


class ResidentKVCalls:
    """The `Backend` protocol's resident-KV calls over the engine's pool."""

    scheduler: Scheduler
    cache: KVCache
    read_pace: ReadPace  # snapshot reads, timed by import_kv_file
    _call: Callable  # engine.core.loop.EngineLoop._call

    def export_kv(self, owner: str) -> KVExport | None:
        """Copy an owner's resident KV to CPU (None if it has none). The engine thread only
        enqueues the copy (on CUDA); this thread waits for it."""
        kv, wait = self._call(lambda: self.scheduler.resident.export(owner, self.cache))
        wait()
        return kv

    def import_kv(
        self, owner: str, kv: KVExport, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        """Make exported KV resident for `owner` again; False if the pool cannot hold it.
        Leading blocks the prefix cache holds (as `submit` keys them) are shared, not loaded.
        Raises InvalidRequest if its shape does not fit this model."""
        sched = self.scheduler
        reclaim = lambda need: sched.reclaim(need, keep_owner=owner)  # noqa: E731
        return self._call(
            lambda: sched.resident.load(
                owner, kv, self.cache, reclaim, cache_ns, max(0, shareable_prefix)
            )
        )

    def import_kv_file(
        self, owner: str, kv: KVFile, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        """`import_kv` of KV stored in a file; False if the pool cannot hold it. On a CPU pool
        the file is read on the calling thread straight into blocks the engine thread sets
        aside, so no step waits for the disk. Raises KVFileDamaged for a short, unreadable or
        corrupted file, InvalidRequest as `import_kv`."""
        _, layers, heads, _, dim = self.cache.data.shape
        if kv.shape != (layers, len(kv.token_ids), heads, dim):
            raise InvalidRequest(f"KV of shape {kv.shape} does not fit this model")
        if not self.cache.reads_files(kv):  # read here, copied into the pool by the engine
            t0 = time.perf_counter()
            k, v = read_kv_file(kv)
            self.read_pace.add(kv_file_bytes(kv), time.perf_counter() - t0)
            return self.import_kv(owner, KVExport(kv.token_ids, k, v), cache_ns, shareable_prefix)
        sched = self.scheduler
        reclaim = lambda need: sched.reclaim(need, keep_owner=owner)  # noqa: E731
        res = self._call(
            lambda: sched.resident.reserve(
                owner, kv.token_ids, reclaim, cache_ns, max(0, shareable_prefix)
            )
        )
        if res is None:
            return False
        loaded = False
        try:
            t0 = time.perf_counter()
            self.cache.load_file(res.block_table, kv, res.start)
            self.read_pace.add(kv_file_bytes(kv), time.perf_counter() - t0)
            loaded = True
        finally:
            resident = self._call(lambda: sched.resident.finish(res, loaded))
        return resident

    def read_s(self, nbytes: int) -> float | None:
        """Seconds reading `nbytes` of snapshot into the pool takes at the pace measured so
        far (None before the first read)."""
        return self.read_pace.seconds(nbytes)

    def drop_kv(self, owner: str) -> bool:
        """Free an owner's resident KV; True if it had any."""
        return self._call(lambda: self.scheduler.resident.drop(owner))

    def reset_prefix_cache(self) -> int:
        """Forget the KV of every cached block nobody holds (benchmarks measure cold turns
        with it); returns how many blocks were forgotten."""
        return self._call(self.scheduler.pool.forget_cached)

    def resident_kv(self) -> dict[str, tuple[int, int, float]]:
        """owner -> (tokens, blocks, seconds idle) of every resident KV."""
        return self._call(self.scheduler.resident.summary)
