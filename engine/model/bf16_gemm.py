"""Steps of many rows through the 4-bit linears on oneDNN's bfloat16 GEMM, where the CPU has
AMX tiles (Sapphire Rapids and later Xeons), when the operator asks for it.

The int8-activation kernel (csrc/q4_linear.cpp) scales every group of 32 integer sums in
float32, so at many rows AMX's tiles spend most of their time waiting for that scaling. Above
`--cpu-bf16-above` rows a call instead widens the layer's 4-bit weights to bfloat16
(csrc/q4_dequant.cpp: `q * scale + offset`, rounded to nearest, into a scratch buffer reused
call after call, no copy kept) and multiplies on PyTorch's bf16 matmul (oneDNN, AMX), bf16
in and out as the dense copies round (engine.model.cpu_quant.DenseCopy). One layer's four
projections at 504 rows: 3.2 ms against 4.9 on the kernel; at 256 rows 2.0 against 2.5; below
~170 rows the kernel wins (2-core Sapphire Rapids-class Xeon, docs/PERFORMANCE.md). The values
differ from the int8 kernel's by the activations' rounding (bf16 instead of int8 per group): a
sequence's logits then depend, within the nf4 tolerance (tests/test_batching.py), on whether
its step had many rows, as with the dense copies. That is why it is off by default: on the int8
kernel a row's values are bitwise the same in any batch and any chunking of its prompt, so two
users sending the same conversation get the same greedy reply whatever the prefix cache held
(tests/test_crash.py holds a restored session to its twin's exact reply); with it they may
differ at near ties.
"""

from __future__ import annotations

import threading

import torch

from engine.kernels import cpu_kernels

# rows: the crossover measured on a 2-core Sapphire Rapids-class Xeon, what an operator who
# opts in would set (`--cpu-bf16-above 192`)
SUGGESTED_ABOVE = 192
SLICE = 1 << 24  # at most this many weights widened at once (32 MB of bf16): wider in slices

_local = threading.local()


def available() -> bool:
    """Whether this CPU and build widen the int8 kernel's layout and have AMX's bf16 tiles."""
    return (
        cpu_kernels.loaded()
        and cpu_kernels.q8_activations()
        and cpu_kernels.q4_dot_layout()
        and torch.cpu._is_amx_tile_supported()
        and hasattr(torch.ops.crowdchat, "q4_dequant_bf16_")
    )


def rows_above(setting: int) -> int:
    """Rows above which a call takes the bf16 GEMM: `--cpu-bf16-above` where `available`;
    0: never (the default)."""
    return setting if setting > 0 and available() else 0


def _scratch(k: int, n: int) -> torch.Tensor:
    """A bfloat16 [k, n] buffer of this thread's, reused from call to call."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < k * n:
        buf = _local.buf = torch.empty(k * n, dtype=torch.bfloat16)
    return buf[: k * n].view(k, n)


def widened(packed: torch.Tensor, so: torch.Tensor, first: int, columns: int) -> torch.Tensor:
    """Columns [16 first, 16 first + columns) of the int8 kernel's 4-bit weights (`packed`,
    `so`: engine.model.cpu_quant.pack_for_dot's q8 layout) as bfloat16 [K, columns], in this
    thread's scratch buffer (valid until its next call)."""
    out = _scratch(packed.shape[1] * 32, columns)
    return torch.ops.crowdchat.q4_dequant_bf16_(packed, so, out, first)


def matmul(x: torch.Tensor, packed: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
    """`x W^T` (x float32 [rows, K]) for the 4-bit W in the int8 kernel's layout, on the bf16
    GEMM: x rounded to bf16, the result rounded to bf16, as float32 [rows, N]."""
    k, n = packed.shape[1] * 32, packed.shape[0] * 16
    xb = x.to(torch.bfloat16)
    step = max(16, SLICE // k // 16 * 16)
    parts = [
        torch.mm(xb, widened(packed, so, n0 // 16, min(step, n - n0))) for n0 in range(0, n, step)
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).float()
