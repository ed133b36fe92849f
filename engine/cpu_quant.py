"""Weight-only quantized linears for CPU, on PyTorch's own int4/int8 kernels.

bitsandbytes has no fused CPU kernel on most CPUs: its CPU path dequantizes every weight on
every call, so a 4-bit model decodes several times slower than the same model unquantized.
PyTorch core ships weight-only kernels that read the packed weights directly
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`; torchao wraps the same ops). On CPU
`--quant nf4` therefore means 4-bit weights in groups of 32 along the input, each with a scale
and a minimum (GGUF's Q4_1 format), and `--quant int8` means int8 weights with one scale per
output channel. The output projection (tied to the embeddings in small models) is int8 in both
modes: it is the largest matrix, and 8 bits keep the logits close.

The kernels are fast with bfloat16 activations only (their float32 paths are scalar), so
activations are cast to bfloat16 around the matmul and back. Where a step's rows are many
(a prefill chunk, a crowd of decodes) a dense matmul of the *dequantized* weights is faster
on CPUs without native bfloat16; a dense copy of the same quantized values is kept for that
when the operator allows the memory (`--cpu-dense-above`), so both paths compute the same model,
rounded the same way (bf16 in and out).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# GGUF's Q4_1 block: a Q4_1 model requantizes without loss (greedy replies equal float32's on
# the embedded model). 64 was tried for speed and broke the model ("1.1.1.1..." for "count
# from 1 to 20"); the kernel's slow group-32 path at many rows is avoided by the dense copy.
GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16


class Int4Linear(nn.Module):
    """y = x W^T with W in 4 bits, groups of 32 along K, each `(q - 8) * scale + zero`."""

    def __init__(self, weight: torch.Tensor, dense_rows: int | None) -> None:
        super().__init__()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        self.group_size = g = GROUP_SIZE
        w = weight.detach().float().view(n, k // g, g)
        lo, hi = w.amin(-1), w.amax(-1)
        # the kernel takes its scale and zero (the value of q = 8) in bfloat16: round them
        # first and quantize against the rounded ones
        scale = ((hi - lo) / 15).clamp(min=1e-10).to(KERNEL_DTYPE).float()
        zeros = (lo + 8 * scale).to(KERNEL_DTYPE).float()
        q = torch.round((w - zeros[..., None]) / scale[..., None]) + 8
        q = q.clamp(0, 15).to(torch.int32).view(n, k)
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False
        )
        sz = torch.stack([scale.t(), zeros.t()], -1).contiguous().to(KERNEL_DTYPE)
        self.register_buffer("scales_and_zeros", sz, persistent=False)  # [K/32, N, 2]
        dense = None
        if dense_rows is not None:
            # the same values the kernel computes with (bf16 scales), in the activation dtype
            s, z = sz[..., 0].t().float(), sz[..., 1].t().float()  # [N, K/32]
            deq = (q.view(n, -1, g) - 8) * s[..., None] + z[..., None]
            dense = deq.view(n, k).to(weight.dtype)
        self.register_buffer("dense", dense, persistent=False)
        self.dense_rows = dense_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] > self.dense_rows:
            return _like_kernel(x, self.dense)
        y = torch._weight_int4pack_mm_for_cpu(  # torch's binding: ~4 us less a call than ops.aten
            x2.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T with W in int8, one symmetric scale per output channel."""

    def __init__(self, weight: torch.Tensor, dense_rows: int | None) -> None:
        super().__init__()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        w = weight.detach().float()
        scale = _bf16_at_least(w.abs().amax(1) / 127)  # the kernel's scale is bfloat16
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", scale.to(KERNEL_DTYPE), persistent=False)
        dense = None
        if dense_rows is not None:
            dense = (q.float() * self.scales.float()[:, None]).to(weight.dtype)
        self.register_buffer("dense", dense, persistent=False)
        self.dense_rows = dense_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] > self.dense_rows:
            return _like_kernel(x, self.dense)
        y = torch._weight_int8pack_mm(x2.to(KERNEL_DTYPE), self.qweight, self.scales)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


def _like_kernel(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The dense path rounded as the kernels round (bf16 in, bf16 out), so a sequence's
    logits do not depend on whether its step had few rows (kernel) or many (dense)."""
    if x.dtype == KERNEL_DTYPE:
        return F.linear(x, dense)
    return F.linear(x.to(KERNEL_DTYPE).to(x.dtype), dense).to(KERNEL_DTYPE).to(x.dtype)


def split_forward(linear: nn.Module, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """`linear(x)` split into `sizes` along the output. On the packed kernel one call computes
    every part (bitwise what separate matrices give); on the dense copy each part is its own
    matmul, because oneDNN blocks a bf16 GEMM by its width too and a wider one can round
    differently (measured: 1 bf16 ulp at 237 rows), while at many rows a call's overhead is
    nothing next to its arithmetic."""
    dense = getattr(linear, "dense", None)
    if dense is not None and x.numel() // linear.in_features > linear.dense_rows:
        return tuple(_like_kernel(x, w) for w in dense.split(sizes))
    return linear(x).split(sizes, dim=-1)


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 values >= x (and > 0), as float32."""
    x = x.clamp(min=1e-10)
    b = x.to(KERNEL_DTYPE).float()
    up = torch.nextafter(x.to(KERNEL_DTYPE), torch.tensor(float("inf"), dtype=KERNEL_DTYPE))
    return torch.where(b >= x, b, up.float())


def available() -> bool:
    """Whether this torch build has the CPU weight-only kernels."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_weight_int8pack_mm")


def quantize_model(model: nn.Module, quant: str, dense_rows: int | None) -> str:
    """Replace the decoder's linears (int4 or int8 per `quant`) and the output projection
    (int8) in place. Returns the kernel's name for the KV fingerprint and the admin page."""
    from engine.fused_proj import fuse_projections  # it builds on this module's linears

    make = Int4Linear if quant == "nf4" else Int8Linear
    # q/k/v and gate/up first, each group as one packed matrix (see engine.fused_proj)
    groups = fuse_projections(
        model,
        lambda w: make(w, dense_rows),
        split_forward,
        lambda m: make is not Int4Linear or m.in_features % GROUP_SIZE == 0,
    )
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.bias is not None:
                continue
            lm_head = child is model.get_output_embeddings()
            k = child.in_features
            if lm_head:
                setattr(parent, name, Int8Linear(child.weight, dense_rows))
            elif make is Int4Linear and k % GROUP_SIZE:
                continue  # a shape the int4 kernel cannot group: stays dense
            else:
                setattr(parent, name, make(child.weight, dense_rows))
            swapped += 1
    log.info(
        "CPU weight-only %s on %d linears + %d fused groups (dense above %s rows)",
        quant,
        swapped,
        groups,
        dense_rows,
    )
    return f"torch-int4g{GROUP_SIZE}" if quant == "nf4" else "torch-int8"
