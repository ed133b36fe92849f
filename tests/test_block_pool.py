"""Block accounting: never more than exist, never one twice, free + used == total."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core.block_pool import BlockPool


def test_allocate_and_free_keep_exact_accounting() -> None:
    pool = BlockPool(10, 16)
    a = pool.allocate(3)
    b = pool.allocate(7)
    assert len(set(a + b)) == 10 and pool.num_free == 0 and pool.num_used == 10
    assert not pool.can_allocate(1)
    pool.free(a)
    assert pool.num_free == 3
    pool.check_integrity()


def test_double_free_and_over_allocation_are_caught() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.allocate(5)


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(4, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_random_churn_never_breaks_integrity() -> None:
    rng = random.Random(0)
    pool = BlockPool(64, 8)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not pool.can_allocate(1)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 8)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
        pool.check_integrity()
        assert pool.num_used == sum(map(len, held))


def test_refcounts_follow_sharing_and_released_chains_stay_cached() -> None:
    pool = BlockPool(4, 2)
    chain = pool.allocate(2)
    assert pool.register(chain[0], b"h0") and pool.register(chain[1], b"h1")
    assert pool.lookup([b"h0", b"h1", b"h2"]) == chain
    pool.share(chain)  # a second holder
    assert [pool.refcount(b) for b in chain] == [2, 2] and pool.num_shared == 2
    pool.check_integrity(Counter(chain * 2))
    pool.free(chain)
    pool.free(chain)  # nobody holds them: cached, still found, and counted as free
    assert pool.num_used == 0 and pool.num_cached == 2 and pool.num_free == 4
    assert pool.lookup([b"h0", b"h1"]) == chain
    pool.share(chain[:1])  # a hit takes a cached block back
    assert pool.num_cached == 1 and pool.refcount(chain[0]) == 1
    pool.check_integrity(Counter(chain[:1]))


def test_empty_blocks_go_first_then_cached_ones_tail_first() -> None:
    pool = BlockPool(4, 2)
    chain = pool.allocate(3)
    for i, b in enumerate(chain):
        pool.register(b, f"h{i}".encode())
    pool.free(chain)
    assert pool.allocate(1) not in ([b] for b in chain)  # the empty block first
    evicted = pool.allocate(1)
    assert evicted == [chain[2]] and pool.lookup([b"h0", b"h1", b"h2"]) == chain[:2]
    assert pool.num_evicted == 1
    pool.check_integrity()


def test_a_twin_chain_is_not_registered_and_a_shared_block_is_never_allocated() -> None:
    pool = BlockPool(3, 2)
    a, b = pool.allocate(1), pool.allocate(1)
    assert pool.register(a[0], b"same") and not pool.register(b[0], b"same")
    assert not pool.register(a[0], b"other")  # a hashed block keeps its hash
    pool.free(b)  # unhashed: empty again, not cached
    assert pool.num_cached == 0 and pool.num_free == 2
    with pytest.raises(AssertionError):
        pool.share(b)  # only cached (hashed) blocks are shared: b may be written
    pool.share(a)
    assert sorted(pool.allocate(2) + a) == [0, 1, 2]  # a held block is never handed out
