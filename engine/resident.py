"""Idle owners' KV kept in the pool after their turn, so their next turn reuses the prefix."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool
from engine.errors import InvalidRequest
from engine.kv_cache import KVCache


@dataclass(frozen=True)
class KVExport:
    """An owner's resident KV copied to CPU: the token ids it covers, K and V `[L, T, H_kv, D]`."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class ResidentKV:
    """An idle owner's KV: the token ids it covers and the blocks that hold them."""

    token_ids: list[int]
    block_table: list[int]
    last_used: float = field(default_factory=time.monotonic)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ResidentCache:
    """owner -> ResidentKV, least recently used first. Frees blocks back to the pool when an
    entry is dropped or trimmed. Only the engine thread calls this."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._entries: OrderedDict[str, ResidentKV] = OrderedDict()
        self.num_dropped = 0  # entries dropped to make room (not by their owner's request)

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
        return sum(len(e.block_table) for e in self._entries.values())

    def put(self, owner: str, entry: ResidentKV) -> None:
        """Make `entry` the owner's resident KV (freeing any older one), most recent last."""
        self.drop(owner)
        self._entries[owner] = entry

    def take(self, owner: str) -> ResidentKV | None:
        """Remove the owner's entry without freeing its blocks (a sequence adopts them)."""
        return self._entries.pop(owner, None)

    def drop(self, owner: str) -> bool:
        """Free the owner's resident KV; True if it had any."""
        entry = self._entries.pop(owner, None)
        if entry is None:
            return False
        self.pool.free(entry.block_table)
        return True

    def reusable(self, owner: str | None, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` whose KV the owner's entry already holds."""
        entry = self._entries.get(owner) if owner is not None else None
        return common_prefix(entry.token_ids, token_ids) if entry is not None else 0

    def trim(self, owner: str, num_tokens: int) -> None:
        """Keep only the KV of the owner's first `num_tokens` tokens; free the rest."""
        entry = self._entries.get(owner)
        if entry is None or num_tokens >= len(entry.token_ids):
            return
        if num_tokens == 0:
            self.drop(owner)
            return
        keep = self.pool.blocks_for(num_tokens)
        self.pool.free(entry.block_table[keep:])
        entry.token_ids = entry.token_ids[:num_tokens]
        entry.block_table = entry.block_table[:keep]

    def evict_lru(self, needed: int, keep_owner: str | None = None) -> None:
        """Drop least recently used entries (never `keep_owner`'s) until `needed` blocks
        are free or nothing else is left to drop."""
        for owner in list(self._entries):
            if self.pool.can_allocate(needed):
                return
            if owner != keep_owner:
                self.drop(owner)
                self.num_dropped += 1

    def export(self, owner: str, cache: KVCache) -> KVExport | None:
        """A CPU copy of the owner's resident KV (None if it has none)."""
        entry = self._entries.get(owner)
        if entry is None:
            return None
        k, v = cache.export(entry.block_table, len(entry.token_ids))
        return KVExport(list(entry.token_ids), k, v)

    def summary(self) -> dict[str, tuple[int, int, float]]:
        """owner -> (tokens, blocks, seconds idle) of every entry."""
        now = time.monotonic()
        return {
            o: (len(e.token_ids), len(e.block_table), now - e.last_used)
            for o, e in self._entries.items()
        }

    def load(
        self, owner: str, kv: KVExport, cache: KVCache, reclaim: Callable[[int], bool]
    ) -> bool:
        """Make `kv` the owner's resident KV; False if `reclaim` cannot free enough blocks."""
        _, layers, heads, _, dim = cache.data.shape
        shape = (layers, len(kv.token_ids), heads, dim)
        if not kv.token_ids or tuple(kv.k.shape) != shape or tuple(kv.v.shape) != shape:
            raise InvalidRequest(
                f"KV of shape {tuple(kv.k.shape)} does not fit this model (expected {shape})"
            )
        self.drop(owner)
        need = self.pool.blocks_for(len(kv.token_ids))
        if not reclaim(need):
            return False
        blocks = self.pool.allocate(need)
        try:
            cache.load(blocks, kv.k, kv.v)
        except BaseException:
            self.pool.free(blocks)  # a failed copy must not leak the blocks
            raise
        self.put(owner, ResidentKV(list(kv.token_ids), blocks))
        return True

    def blocks(self) -> list[int]:
        """Every block the entries hold (for integrity checks)."""
        return [b for e in self._entries.values() for b in e.block_table]
