"""Weights for the CPU quantization tests (tests/test_cpu_quant*.py)."""

from __future__ import annotations

import torch

from engine.model.cpu_quant import GROUP_SIZE


def q4_1_weights(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Weights on a Q4_1-like grid: per group, `min + d * q` with q in 0..15 (both ends
    used), the range spanning zero as trained weights do."""
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=gen) * 0.01 + 1e-4
    lo = -d * (5 + 5 * torch.rand(n, k // GROUP_SIZE, 1, generator=gen))
    return (lo + d * q).view(n, k)
