"""Temperature-only sampling on CUDA in Triton: a row's pick in one launch for the whole batch.

The tensor-op path (engine.model.sampler `_pick`: max, subtract, exp, running sums, a scaled
uniform, searchsorted, clamp) is ~8 launches over [N, V] floats a step; the CPU has its own
kernel for it (csrc/sample.cpp). Here one program a row makes three passes over its logits
(already divided by the temperature): the max, the sum of exp(x - max), then the number of
running sums at or below u x sum, which is the index searchsorted(right=True) finds. A row's
pick depends on its own logits and uniform only, so a seeded request draws the same alone or
in any batch; -inf logits weigh 0 and are never drawn, even where u x sum rounds to the sum.
On the CPU the tests run it under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_attention import available

BLOCK = 4096  # logits a pass reads at a time

if available():
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_kernel(rows_ptr, u_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = rows_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
            top = tl.maximum(top, x)
        m = tl.max(top, axis=0)
        sums = tl.zeros([BLOCK], tl.float32)
        last = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
            w = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
            sums += w
            last = tl.maximum(last, tl.where(w > 0, start + cols, -1))
        total = tl.sum(sums, axis=0)
        at = tl.load(u_ptr + row).to(tl.float32) * total
        below = tl.zeros([BLOCK], tl.int32)
        running = total * 0.0
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
            w = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
            cdf = running + tl.cumsum(w, axis=0)
            below += tl.where((cdf <= at) & (start + cols < V), 1, 0)
            running += tl.sum(w, axis=0)
        # u x total can round up to the total: the last token of positive weight, not past it
        pick = tl.minimum(tl.sum(below, axis=0), tl.max(last, axis=0))
        tl.store(out_ptr + row, pick.to(tl.int64))


def sample_rows(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `rows` ([N, V] float32 logits already divided by the temperature) the index
    drawn from softmax(row) by the row's uniform in `u` ([N] float64, in [0, 1)): int64 [N]."""
    n, v = rows.shape
    assert rows.dtype == torch.float32 and rows.stride(1) == 1 and u.shape == (n,)
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n:
        block = min(BLOCK, triton.next_power_of_2(v))
        _sample_kernel[(n,)](rows, u, out, v, rows.stride(0), BLOCK=block)
    return out
