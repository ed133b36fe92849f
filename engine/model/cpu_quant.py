"""Weight-only quantized linears for CPU, on PyTorch's own int4/int8 kernels.

bitsandbytes has no fused CPU kernel on most CPUs: its CPU path dequantizes every weight on
every call, so a 4-bit model decodes several times slower than the same model unquantized.
PyTorch core ships weight-only kernels that read the packed weights directly
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`; torchao wraps the same ops). On CPU
`--quant nf4` therefore means 4-bit weights in groups of 32 along the input, each with a scale
and a minimum (GGUF's Q4_1 format), and `--quant int8` means int8 weights with one scale per
output channel. The output projection (tied to the embeddings in small models) is int8 in both
modes (float16 beside float16 dense copies, below): it is the largest matrix, and 8 bits keep
the logits close.

The kernels are fast with bfloat16 activations only (their float32 paths are scalar), so
activations are cast to bfloat16 around the matmul and back. Where compute is float32 (CPUs
without native bfloat16, where PyTorch's int4 kernel widens its bf16 activations group by
group) the 4-bit weights run on crowdchat's own kernel instead (`csrc/q4_linear.cpp`, built by
engine.kernels.cpu_kernels), which rounds the same way and computes the same values to one bf16 ulp.
On CPUs with AVX512-BF16 that kernel multiplies bfloat16 pairs (`vdpbf16ps`, twice the rate of
float32 FMAs) from its own layout (`pack_for_dot`) and outruns every dense copy below, so none
is kept there unless `--cpu-dense-above` asks for one. With int8 activations
(`--cpu-activations auto`, on AVX512-VNNI and on AVX2) x is rounded to int8 per group of 32 as
llama.cpp rounds it and each group's sums are integers; on AVX2 in a layout of its own
(`pack_for_avx2`, csrc/q8_avx2.cpp), which also outruns the dense copies at every row count,
so there too none is kept and the output projection runs in int8.

Where a step's rows are many (a prefill chunk, a crowd of decodes) a dense matmul of the
*dequantized* weights is faster; a dense copy of the same quantized values is kept for that
when the operator allows the memory (`--cpu-dense-above`), rounded the same way as the kernels
(bf16 in and out), so both paths compute the same model. Where compute is float32 (CPUs without
native bfloat16) that copy is float16, packed for FBGEMM's fp16 GEMM
(`quantized::linear_dynamic_fp16`, in PyTorch core: it widens the weights to float32 in
registers, so it reads half the bytes of a float32 matmul and is 1.5-2.5x faster at 8-64 rows
on the 2-core AVX2 EPYC; docs/PERFORMANCE.md). Every weight rounds to float16
within 2**-11 of itself (relative), far below the bf16 rounding of the activations (2**-8). The
output projection then runs on a float16 copy at every row count: there FBGEMM was faster than
the int8 kernel even at one row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.model import bf16_gemm

# GGUF's Q4_1 block: a Q4_1 model requantizes without loss (greedy replies equal float32's on
# the embedded model). 64 was tried for speed and broke the model ("1.1.1.1..." for "count
# from 1 to 20"); the kernel's slow group-32 path at many rows is avoided by the dense copy.
GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16


# Rows per step above which the dense copy runs, by its kind (`--cpu-dense-above` unset). On
# the 2-core AVX2 EPYC one layer's four projections took 0.66 / 0.91 / 1.50 ms on the int4 kernel
# at 1 / 4 / 6 rows and 0.89 / 0.98 / 1.01 on FBGEMM's fp16 GEMM; bf16 dense copies (on CPUs
# with native bf16) overtook the kernel past 16 rows.
FP16_DENSE_ABOVE = 4
DENSE_ABOVE = 16


def fp16_gemm_available() -> bool:
    """Whether this torch build and CPU run FBGEMM's fp16 GEMM (x86 with AVX2)."""
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    )


class DenseCopy(nn.Module):
    """The quantized weights' values as a dense matrix `[N, K]`, for steps of many rows:
    float16 packed for FBGEMM where compute is float32 (`fp16`), else in the compute dtype."""

    def __init__(self, values: torch.Tensor, dtype: torch.dtype, fp16: bool) -> None:
        super().__init__()
        self.packed = None
        if fp16:
            self.packed = torch.ops.quantized.linear_prepack_fp16(values.float().contiguous(), None)
        self.register_buffer("weight", None if fp16 else values.to(dtype), persistent=False)
        # what `get_memory_footprint` (parameters and buffers) cannot see in the packed object
        self.packed_bytes = values.numel() * 2 if fp16 else 0

    def values(self) -> torch.Tensor:
        """The weights this copy computes with, as float32 `[N, K]`."""
        if self.packed is not None:
            return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]
        return self.weight.float()

    def forward(self, x: torch.Tensor, sizes: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        """`x W^T`, rounded as the kernels round (bf16 in, bf16 out), so a sequence's logits
        barely depend on whether its step had few rows (kernel) or many (this copy); split into
        `sizes` along the output when given. FBGEMM computes each output column the same way
        whatever the matrix's width, so one call serves every part; a bf16 GEMM is blocked by
        its width too and can round a part 1 ulp differently (measured at 237 rows), so there
        each part is its own matmul."""
        rounded = x if x.dtype == KERNEL_DTYPE else round_bf16(x)
        if self.packed is not None:  # float32 compute
            y = round_bf16(torch.ops.quantized.linear_dynamic_fp16(rounded, self.packed), True)
            return y.split(sizes, dim=-1) if sizes else (y,)
        weights = self.weight.split(sizes) if sizes else (self.weight,)
        parts = tuple(F.linear(rounded, w) for w in weights)
        if x.dtype == KERNEL_DTYPE:
            return parts
        return tuple(round_bf16(p, inplace=True) for p in parts)


def round_bf16(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """`x`'s values rounded to bfloat16, kept in its dtype (`x.to(bf16).to(x.dtype)`): one pass
    on crowdchat's kernel (`csrc/elementwise.cpp`) for contiguous float32, in place with
    `inplace`; else ATen's two casts."""
    if x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and cpu_kernels.loaded():
        op = torch.ops.crowdchat.round_to_bf16_ if inplace else torch.ops.crowdchat.round_to_bf16
        return op(x)
    return x.to(KERNEL_DTYPE).to(x.dtype)


class QuantLinear(nn.Module):
    """A weight-only quantized linear: the packed kernel for few rows, the dense copy (when
    kept) for more than `dense_rows`."""

    def __init__(self, n: int, k: int, dense: DenseCopy | None, dense_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n
        self.dense = dense
        self.dense_rows = dense_rows

    def uses_dense(self, x: torch.Tensor) -> bool:
        return self.dense is not None and x.numel() // self.in_features > self.dense_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_dense(x):
            return self.dense(x)[0]
        shape = x.shape
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.view(*shape[:-1], self.out_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` on the packed weights, `x` `[rows, K]`, rounded to bf16 in and out."""
        raise NotImplementedError


class Int4Linear(QuantLinear):
    """y = x W^T with W in 4 bits, groups of 32 along K, each `(q - 8) * scale + zero`: on
    PyTorch's int4 kernel, or with `own` (float32 compute) on crowdchat's
    (engine.kernels.cpu_kernels),
    1.2-1.9x faster a call on the 2-core AVX2 EPYC (docs/PERFORMANCE.md). With
    `q8` too, where the kernels have it (AVX512-VNNI, or AVX2 with columns a multiple of 8),
    x is rounded to int8 per group of 32 (llama.cpp's Q8 activations) instead of bfloat16:
    ~1.9x faster at 8-32 rows on AVX512, 2x at 1 row and 2.4x at 32 on AVX2."""

    def __init__(
        self, weight: torch.Tensor, dense: DenseKind | None, own: bool = False, q8: bool = False
    ) -> None:
        n, k = weight.shape
        g = GROUP_SIZE
        w = weight.detach().float().view(n, k // g, g)
        lo, hi = w.amin(-1), w.amax(-1)
        # the kernel takes its scale and zero (the value of q = 8) in bfloat16: round them
        # first and quantize against the rounded ones
        scale = ((hi - lo) / 15).clamp(min=1e-10).to(KERNEL_DTYPE).float()
        zeros = (lo + 8 * scale).to(KERNEL_DTYPE).float()
        q = torch.round((w - zeros[..., None]) / scale[..., None]) + 8
        q = q.clamp(0, 15).to(torch.int32).view(n, k)
        sz = torch.stack([scale.t(), zeros.t()], -1).contiguous().to(KERNEL_DTYPE)
        copy = None
        if dense is not None:
            # the same values the kernel computes with (bf16 scales)
            s, z = sz[..., 0].t().float(), sz[..., 1].t().float()  # [N, K/32]
            copy = dense.copy(((q.view(n, -1, g) - 8) * s[..., None] + z[..., None]).view(n, k))
        super().__init__(n, k, copy, dense.rows if dense else 0)
        self.group_size = g
        self.own = own
        self.q8 = False
        # rows above which a call runs on the bf16 GEMM (engine.model.bf16_gemm; 0: never),
        # set by quantize_model for the AVX-512 int8-activation layout (`widens`)
        self.bf16_rows = 0
        self.widens = False
        if own and n % 16 == 0 and cpu_kernels.q4_dot_layout():
            self.q8 = self.widens = q8 and cpu_kernels.q8_activations()
            # the AVX512-BF16 kernel's layout (float32 scales: its int8-activation variant)
            packed, sz = pack_for_dot(q, sz, self.q8)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_zeros", sz, persistent=False)
        elif own and q8 and n % 8 == 0 and cpu_kernels.q8_activations():
            self.q8 = True  # the AVX2 int8-activation kernel (csrc/q8_avx2.cpp)
            packed, sz = pack_for_avx2(q, sz)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_zeros", sz, persistent=False)
        elif own:  # csrc/q4_linear.cpp's layout: q[j] and q[j + 16] share byte j of a group
            nibbles = q.to(torch.uint8).view(n, -1, g)
            packed = nibbles[..., : g // 2] | (nibbles[..., g // 2 :] << 4)
            self.register_buffer("packed", packed.contiguous(), persistent=False)
            # [N, K/32, 2]: a row's groups next to its nibbles
            self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous(), persistent=False)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros", sz, persistent=False)  # [K/32, N, 2]

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_rows and x.shape[0] > self.bf16_rows:
            return bf16_gemm.matmul(x, self.packed, self.scales_zeros)
        if self.own:  # float32 in and out, rounded to bf16 inside
            return torch.ops.crowdchat.q4_linear(x, self.packed, self.scales_zeros)
        # torch's binding: ~4 us less a call than ops.aten
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype)


def pack_for_dot(
    q: torch.Tensor, sz: torch.Tensor, q8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/q4_linear.cpp's AVX512-BF16 layout of `q` (int [N, K], 0..15) and `sz` (bfloat16
    [K/32, N, 2]): columns in blocks of 16; per 4 values of K 32 bytes, byte i for column
    i // 2, its low nibble K = 4t + i % 2, its high one 4t + 2 + i % 2 (the bfloat16 pairs
    `vdpbf16ps` multiplies); scales, then zeros, of a block's 16 columns side by side. With
    `q8` (the int8-activation kernel) the layout `vpdpbusd` unpacks in two instructions: per
    group 4 x 64 bytes, byte 4c + j of the p-th holding column c's q[8p + j] (low nibble) and
    q[8p + 4 + j] (high nibble); float32 scales, then offsets `zero - 8 scale` (exact)."""
    n, k = q.shape
    q = q.to(torch.uint8)
    if q8:  # block, group, pair p, half, column, j: K = 32 group + 8 p + 4 half + j
        u = q.view(n // 16, 16, k // GROUP_SIZE, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        byte = u[:, :, :, 0] | (u[:, :, :, 1] << 4)
        packed = byte.reshape(n // 16, k // GROUP_SIZE, 256)
    else:
        quads = q.view(n // 16, 16, k // 4, 2, 2)  # block, column, t, half, i % 2
        byte = quads[..., 0, :] | (quads[..., 1, :] << 4)
        packed = byte.permute(0, 2, 1, 3).reshape(n // 16, k // GROUP_SIZE, 256)
    s = sz.view(k // GROUP_SIZE, n // 16, 16, 2).permute(1, 0, 3, 2)
    if q8:
        s = s.float()
        s = torch.stack([s[:, :, 0], s[:, :, 1] - 8 * s[:, :, 0]], 2)
    return packed.contiguous(), s.reshape(n // 16, k // GROUP_SIZE, 32).contiguous()


def pack_for_avx2(q: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/q8_avx2.cpp's layout of `q` (int [N, K], 0..15) and `sz` (bfloat16 [K/32, N, 2]):
    columns in blocks of 8; per 8 values of K (K = 8p + j and 8p + 4 + j) 32 bytes, byte
    4c + j holding column c's q[8p + j] (low nibble) and q[8p + 4 + j] (high nibble): uint8
    [N/8, K/32, 128]; per group the block's 8 bfloat16 scales, then its 8 zeros: [N/8, K/32,
    16]."""
    n, k = q.shape
    eights = q.to(torch.uint8).view(n // 8, 8, k // 8, 2, 4)  # block, column, p, half, j
    byte = eights[:, :, :, 0] | (eights[:, :, :, 1] << 4)  # block, column, p, j
    packed = byte.permute(0, 2, 1, 3).reshape(n // 8, k // GROUP_SIZE, 128)
    s = sz.view(k // GROUP_SIZE, n // 8, 8, 2).permute(1, 0, 3, 2)  # block, g, kind, c
    return packed.contiguous(), s.reshape(n // 8, k // GROUP_SIZE, 16).contiguous()


class Int8Linear(QuantLinear):
    """y = x W^T with W in int8, one symmetric scale per output channel (with `own` and `q8`,
    x in int8 per group of 32 too, as for Int4Linear)."""

    def __init__(
        self, weight: torch.Tensor, dense: DenseKind | None, own: bool = False, q8: bool = False
    ) -> None:
        n, k = weight.shape
        w = weight.detach().float()
        scale = _bf16_at_least(w.abs().amax(1) / 127)  # the kernel's scale is bfloat16
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        copy = dense.copy(q.float() * scale[:, None]) if dense is not None else None
        super().__init__(n, k, copy, dense.rows if dense else 0)
        # `own` (float32 compute): csrc/q4_linear.cpp's AVX512-BF16 int8 kernel where built,
        # else with `q8` csrc/q8_avx2.cpp's
        dot = cpu_kernels.q4_dot_layout()
        q8 = q8 and cpu_kernels.q8_activations()
        fits = n % 16 == 0 if dot else q8 and n % 8 == 0  # AVX2: the int8-x kernel only
        self.own = own and k % GROUP_SIZE == 0 and fits
        self.q8 = self.own and q8
        if self.q8 and not dot:  # csrc/q8_avx2.cpp: [N/8, K/4, 32], bytes 4c + j: K = 4t + j
            qweight = q.view(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 8, k // 4, 32)
            self.register_buffer("qweight", qweight.contiguous(), persistent=False)
            self.register_buffer("scales", scale.contiguous(), persistent=False)
        elif self.q8:  # int8 x too: uint8 q + 128 [N/16, K/4, 64], byte 4c + j: K = 4t + j
            packed = (q.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, k // 4, 4)
            qweight = packed.permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64).contiguous()
            self.register_buffer("qweight", qweight, persistent=False)
            self.register_buffer("scales", scale.contiguous(), persistent=False)
        elif self.own:  # [N/16, K/2, 32]: byte i of a pair of K for column i // 2
            packed = q.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
            qweight = packed.reshape(n // 16, k // 2, 32).contiguous()
            self.register_buffer("qweight", qweight, persistent=False)
            self.register_buffer("scales", scale.contiguous(), persistent=False)
        else:
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("scales", scale.to(KERNEL_DTYPE), persistent=False)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.own:  # float32 in and out, rounded to bf16 inside
            return torch.ops.crowdchat.int8_dot(x, self.qweight, self.scales)
        return torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)


class Fp16Linear(QuantLinear):
    """y = x W^T on FBGEMM's float16 GEMM at every row count: the output projection where
    compute is float32 and dense copies are kept (faster than the int8 kernel from one row)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        super().__init__(n, k, DenseCopy(weight.detach(), torch.float32, fp16=True), -1)


@dataclass(frozen=True)
class DenseKind:
    """Which dense copy the quantized linears keep, and above how many rows it runs."""

    dtype: torch.dtype  # the compute dtype
    fp16: bool  # packed float16 for FBGEMM, else a copy in `dtype`
    rows: int

    def copy(self, values: torch.Tensor) -> DenseCopy:
        return DenseCopy(values, self.dtype, self.fp16)


def split_forward(linear: nn.Module, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """`linear(x)` split into `sizes` along the output. On the packed kernel one call computes
    every part (bitwise what separate matrices give); on the dense copy as `DenseCopy` does."""
    if linear.uses_dense(x):
        return linear.dense(x, sizes)
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


def dense_kind(dtype: torch.dtype, dense_rows: int | None) -> DenseKind | None:
    """The dense copy for `--cpu-dense-above` (`None`: the default for its kind; 0: none)."""
    if dense_rows == 0:
        return None
    fp16 = dtype == torch.float32 and fp16_gemm_available()
    default = FP16_DENSE_ABOVE if fp16 else DENSE_ABOVE
    return DenseKind(dtype, fp16, default if dense_rows is None else dense_rows)
