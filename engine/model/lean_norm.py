"""RMSNorm as one fused op instead of transformers' eight.

A one-row decode step is mostly per-op overhead (docs/PERFORMANCE.md, "Which kernel runs where"):
the embedded model runs 61 RMSNorms a token, each written in transformers as cast, pow, mean, add,
rsqrt, mul, cast, mul. `torch.rms_norm` computes the same float32 formula in one call: its outputs
equal transformers' bitwise (tests/test_lean_norm.py), so swapping it changes no result, including
`generate` on the same model. Where compute is float32 on the CPU and crowdchat's kernels load, the
op is `crowdchat::rms_norm` (`engine/kernels/csrc/rms_norm.cpp`): `torch.rms_norm` is itself ~10
ATen calls there (50-60 us a call for one row on the 2-core EPYC); that one makes only the sum of
squares an ATen call and computes the rest as those calls round it, bitwise the same again.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu_kernels

# Classes whose forward is exactly Llama's: normalize in float32, cast back, scale by weight.
LLAMA_STYLE = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`weight * (x / rms(x)).to(x.dtype)`, the float32 normalization in one op. In float32
    the weight goes into that op too (the same products: no cast between them), one call
    instead of four, which counts at 61 norms a token."""
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        if x.is_cpu and x.is_contiguous() and cpu_kernels.loaded():
            return torch.ops.crowdchat.rms_norm.default(x, module.weight, module.variance_epsilon)
        return torch.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
    h = torch.rms_norm(x.float(), (x.shape[-1],), None, module.variance_epsilon)
    return module.weight * h.to(x.dtype)


def fuse_norms(model: nn.Module) -> int:
    """Give each Llama-style RMSNorm of `model` the one-op forward (loading crowdchat's CPU
    kernels for a model on the CPU). Returns how many."""
    if all(p.is_cpu for p in model.parameters()):
        cpu_kernels.load()
    swapped = 0
    for m in model.modules():
        if type(m).__name__ in LLAMA_STYLE and hasattr(m, "variance_epsilon"):
            m.forward = rms_norm.__get__(m)  # bound method: an instance attribute, per module
            swapped += 1
    return swapped
