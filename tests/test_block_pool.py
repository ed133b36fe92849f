"""Block accounting: never more than exist, never one twice, free + used == total."""

from __future__ import annotations

import random

import pytest

from engine.block_pool import BlockPool


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
