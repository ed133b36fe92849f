"""Exact accounting of the KV pool's blocks: refcounts, the free list, and the prefix cache.

A full block whose KV is computed may be registered under its chain hash (`block_hash`); a
sequence whose prompt starts with a registered chain shares those blocks instead of computing
them. A block nobody holds any more keeps its KV and its hash ("cached"), and is evicted, least
recently released first, only when an allocation finds no empty block left.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque


class BlockPool:
    """Hands out block ids, counts who holds each, and finds cached chains by hash.

    Every block is in exactly one state: empty (free, no hash), cached (free, hashed: reusable
    until evicted) or used (refcount >= 1). Only full, computed blocks are hashed, and a hashed
    block is never written again, so sharing one never lets a sequence see another's writes.
    Pure bookkeeping: the tensors live in `KVCache`. Only the engine thread calls this.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._num_used = 0
        self.num_shared = 0  # blocks held by two or more (sequences or resident chains)
        self.num_evicted = 0  # cached blocks given to someone else

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and cached ones nobody holds."""
        return len(self._empty) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a registered chain's KV."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_hashed(self, block: int) -> bool:
        return block in self._hash_of

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks for writing (refcount 1): empty ones first, then the least recently
        released cached ones, whose hashes are forgotten. The caller checked `can_allocate`."""
        assert self.can_allocate(n), f"asked for {n} blocks, {self.num_free} free"
        blocks = []
        for _ in range(n):
            if self._empty:
                b = self._empty.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.num_evicted += 1
            self._ref[b] = 1
            blocks.append(b)
        self._num_used += n
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Hold cached or used blocks once more (a prefix hit); they are read, never written."""
        for b in blocks:
            assert b in self._hash_of, f"block {b} is not in the prefix cache"
            if self._ref[b] == 0:
                del self._cached[b]
                self._num_used += 1
            elif self._ref[b] == 1:
                self.num_shared += 1
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Let go of blocks once each. One nobody holds any more becomes empty, or cached if
        hashed. A chain is released tail first, so its tail is evicted before its head."""
        for b in reversed(blocks):
            assert self._ref[b] > 0, f"block {b} freed twice or never allocated"
            self._ref[b] -= 1
            if self._ref[b] == 1:
                self.num_shared -= 1
            elif self._ref[b] == 0:
                self._num_used -= 1
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._empty.append(b)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Offer a held, full, computed block to the prefix cache under its chain hash. False
        if it already has a hash or another block holds that chain (a twin computed at the same
        time: the first one stays the cached one)."""
        assert self._ref[block] > 0, f"block {block} registered while nobody holds it"
        if block in self._hash_of or block_hash in self._by_hash:
            return False
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached chain that starts `hashes` (nothing is held yet)."""
        blocks = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def forget_cached(self) -> int:
        """Empty every cached block nobody holds (held blocks stay cached); how many."""
        n = len(self._cached)
        for b in self._cached:
            del self._by_hash[self._hash_of.pop(b)]
            self._empty.append(b)
        self._cached.clear()
        return n

    def check_integrity(self, holders: Counter[int] | None = None) -> None:
        """Every block is exactly one of empty, cached, used; empty + cached + used == total;
        the hash maps mirror each other; with `holders` (block -> how many hold it), every
        refcount equals its number of holders."""
        empty, cached = set(self._empty), set(self._cached)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert len(empty) == len(self._empty), "a block is twice in the empty list"
        assert not (empty & cached) and not (used & (empty | cached))
        assert len(empty) + len(cached) + len(used) == self.num_blocks
        assert len(used) == self._num_used
        assert self.num_shared == sum(1 for r in self._ref if r > 1)
        assert all(b in self._hash_of for b in cached), "a cached block lost its hash"
        assert not any(b in self._hash_of for b in empty), "an empty block kept a hash"
        assert len(self._hash_of) == len(self._by_hash)
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items())
        if holders is not None:
            assert all(self._ref[b] == holders.get(b, 0) for b in range(self.num_blocks)), [
                (b, self._ref[b], holders.get(b, 0))
                for b in range(self.num_blocks)
                if self._ref[b] != holders.get(b, 0)
            ]
