"""Idle owners' KV kept in the pool after their turn, so their next turn reuses the prefix."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.block_hash import extend_hashes
from engine.core.block_pool import BlockPool
from engine.errors import InvalidRequest
from engine.kv_file import KVExport
from engine.model.kv_cache import KVCache


@dataclass
class ResidentKV:
    """An idle owner's KV: the token ids it covers and the chain of blocks that hold them."""

    token_ids: list[int]
    block_table: list[int]
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Reservation:
    """Blocks set aside for an owner's KV while a load fills them (`ResidentCache.reserve`):
    the first `start` tokens' blocks came from the prefix cache, the rest are to be filled."""

    owner: str
    token_ids: list[int]
    block_table: list[int]
    hashes: list[bytes]  # of its full blocks, registered once loaded
    start: int = 0
    dropped: bool = False  # the owner's KV was dropped while it loaded: let go when finished


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ResidentCache:
    """owner -> ResidentKV, least recently used first: each entry holds its chain of blocks
    once (blocks may be shared with other entries and running sequences), and lets go of them
    when it is dropped. Only the engine thread calls this."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._entries: OrderedDict[str, ResidentKV] = OrderedDict()
        self._loading: list[Reservation] = []  # blocks loads are filling
        self.num_dropped = 0  # entries dropped to make room (not by their owner's request)
        self.num_loaded_from_cache = 0  # tokens of loaded KV found in the prefix cache instead
        self._num_blocks: int | None = 0  # `num_blocks`, None when an entry came or went

    def __contains__(self, owner: object) -> bool:
        return owner in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Iterator[tuple[str, ResidentKV]]:
        return iter(list(self._entries.items()))

    def get(self, owner: str) -> ResidentKV | None:
        return self._entries.get(owner)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks the entries hold (a block shared by several counts once). Counted
        again only after a change: the engine publishes it every step."""
        if self._num_blocks is None:
            self._num_blocks = len({b for e in self._entries.values() for b in e.block_table})
        return self._num_blocks

    def put(self, owner: str, entry: ResidentKV) -> None:
        """Make `entry` the owner's resident KV (freeing any older one), most recent last."""
        self.drop(owner)
        self._entries[owner] = entry
        self._num_blocks = None

    def take(self, owner: str) -> ResidentKV | None:
        """Remove the owner's entry without freeing its blocks (a sequence adopts them)."""
        entry = self._entries.pop(owner, None)
        if entry is not None:
            self._num_blocks = None
        return entry

    def drop(self, owner: str) -> bool:
        """Free the owner's resident KV (a load in flight lets its blocks go when it
        finishes); True if it had any."""
        for res in self._loading:
            res.dropped = res.dropped or res.owner == owner
        entry = self._entries.pop(owner, None)
        if entry is None:
            return False
        self._num_blocks = None
        self.pool.free(entry.block_table)
        return True

    def cut(self, entry: ResidentKV, num_tokens: int) -> tuple[list[int], int]:
        """A taken entry's chain cut to its first `num_tokens` tokens, for a sequence to write
        on: the blocks past them are let go, and so is the last kept one if it is partly kept
        but hashed or shared (it must never be written: its tokens are recomputed instead).
        Returns the block table and how many tokens it holds."""
        bs = self.pool.block_size
        keep = self.pool.blocks_for(num_tokens)
        self.pool.free(entry.block_table[keep:])
        table = entry.block_table[:keep]
        if num_tokens % bs and (
            self.pool.is_hashed(table[-1]) or self.pool.refcount(table[-1]) > 1
        ):
            self.pool.free(table[-1:])
            table = table[:-1]
            num_tokens = len(table) * bs
        return table, num_tokens

    def evict_lru(self, needed: int, keep_owner: str | None = None) -> None:
        """Drop least recently used entries (never `keep_owner`'s) until `needed` blocks
        are free or nothing else is left to drop."""
        for owner in list(self._entries):
            if self.pool.can_allocate(needed):
                return
            if owner != keep_owner:
                self.drop(owner)
                self.num_dropped += 1

    def export(self, owner: str, cache: KVCache) -> tuple[KVExport | None, Callable[[], None]]:
        """A CPU copy of the owner's resident KV (None if it has none), and what waits until
        it is filled (`KVCache.export_async`: call it off the engine thread)."""
        entry = self._entries.get(owner)
        if entry is None:
            return None, lambda: None
        k, v, wait = cache.export_async(entry.block_table, len(entry.token_ids))
        return KVExport(list(entry.token_ids), k, v), wait

    def summary(self) -> dict[str, tuple[int, int, float]]:
        """owner -> (tokens, blocks, seconds idle) of every entry."""
        now = time.monotonic()
        return {
            o: (len(e.token_ids), len(e.block_table), now - e.last_used)
            for o, e in self._entries.items()
        }

    def load(
        self,
        owner: str,
        kv: KVExport,
        cache: KVCache,
        reclaim: Callable[[int], bool],
        namespace: str | None = None,
        shareable_prefix: int = 0,
    ) -> bool:
        """Make `kv` the owner's resident KV; False if `reclaim` cannot free enough blocks.
        Its leading full blocks that the prefix cache holds (same tokens, same namespace) are
        shared, not copied: only the rest is loaded."""
        _, layers, heads, _, dim = cache.data.shape
        shape = (layers, len(kv.token_ids), heads, dim)
        if tuple(kv.k.shape) != shape or tuple(kv.v.shape) != shape:
            raise InvalidRequest(
                f"KV of shape {tuple(kv.k.shape)} does not fit this model (expected {shape})"
            )
        res = self.reserve(owner, kv.token_ids, reclaim, namespace, shareable_prefix)
        if res is None:
            return False
        try:
            if res.start < len(kv.token_ids):
                cache.load(res.block_table, kv.k[:, res.start :], kv.v[:, res.start :], res.start)
        except BaseException:
            self.finish(res, loaded=False)  # a failed copy must not leak the blocks
            raise
        return self.finish(res, loaded=True)

    def reserve(
        self,
        owner: str,
        token_ids: list[int],
        reclaim: Callable[[int], bool],
        namespace: str | None = None,
        shareable_prefix: int = 0,
    ) -> Reservation | None:
        """The blocks that will hold the owner's KV of `token_ids` (its old KV is dropped):
        leading ones the prefix cache holds are shared, the rest allocated for a load to fill
        from `res.start` on, then `finish`; None if `reclaim` cannot free enough blocks. The
        blocks belong to nobody meanwhile, so the thread filling them needs no engine time."""
        if not token_ids:
            raise InvalidRequest("KV of no tokens cannot be loaded")
        self.drop(owner)
        hashes: list[bytes] = []
        extend_hashes(hashes, token_ids, self.pool.block_size, namespace, shareable_prefix)
        hits = self.pool.lookup(hashes)
        self.pool.share(hits)  # held first: reclaiming must not evict them
        need = self.pool.blocks_for(len(token_ids)) - len(hits)
        try:
            fresh = self.pool.allocate(need) if reclaim(need) else None
        except BaseException:
            self.pool.free(hits)  # a failed reclaim must not leak the shared blocks
            raise
        if fresh is None:
            self.pool.free(hits)
            return None
        res = Reservation(owner, list(token_ids), hits + fresh, hashes)
        res.start = len(hits) * self.pool.block_size
        self._loading.append(res)
        return res

    def finish(self, res: Reservation, loaded: bool) -> bool:
        """End a reservation: with `loaded` (its blocks hold the KV) the owner's resident KV is
        them, unless the owner's KV was dropped meanwhile; otherwise they are let go. Returns
        whether the KV is resident."""
        self._loading.remove(res)
        if not loaded or res.dropped:
            self.pool.free(res.block_table)
            return False
        for i in range(res.start // self.pool.block_size, len(res.hashes)):
            self.pool.register(res.block_table[i], res.hashes[i])
        self.num_loaded_from_cache += res.start
        self.put(res.owner, ResidentKV(res.token_ids, res.block_table))
        return True

    def blocks(self) -> list[int]:
        """Every block the entries and the loads in flight hold, once per holder (for
        integrity checks)."""
        held = [*self._entries.values(), *self._loading]
        return [b for e in held for b in e.block_table]
