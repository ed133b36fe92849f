"""Exact accounting of the KV pool's fixed-size blocks: a free list and who holds what."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids from a free list; never more than exist, never one twice.

    Pure bookkeeping: the tensors live in `KVCache`. Only the engine thread calls this.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; the caller checked `can_allocate` first."""
        assert self.can_allocate(n), f"asked for {n} blocks, {len(self._free)} free"
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list; each must be held."""
        for b in blocks:
            assert b in self._used, f"block {b} freed twice or never allocated"
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        """free + used == total, and no block is both."""
        assert len(self._free) + len(self._used) == self.num_blocks
        assert not self._used.intersection(self._free)
        assert len(set(self._free)) == len(self._free)
