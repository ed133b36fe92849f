"""RMSNorm as one fused op instead of transformers' eight.

A one-row decode step is mostly per-op overhead (see README "Which kernel runs where"): the
embedded model runs 61 RMSNorms a token, each written in transformers as cast, pow, mean, add,
rsqrt, mul, cast, mul. `torch.rms_norm` computes the same float32 formula in one call: its
outputs equal transformers' bitwise (tests/test_lean_norm.py), so swapping it changes no result,
including `generate` on the same model.
"""

from __future__ import annotations

import torch
from torch import nn

# Classes whose forward is exactly Llama's: normalize in float32, cast back, scale by weight.
LLAMA_STYLE = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`weight * (x / rms(x)).to(x.dtype)`, the float32 normalization in one op. In float32
    the weight goes into that op too (the same products: no cast between them), one call
    instead of four, which counts at 61 norms a token."""
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
    h = torch.rms_norm(x.float(), (x.shape[-1],), None, module.variance_epsilon)
    return module.weight * h.to(x.dtype)


def fuse_norms(model: nn.Module) -> int:
    """Give each Llama-style RMSNorm of `model` the one-op forward. Returns how many."""
    swapped = 0
    for m in model.modules():
        if type(m).__name__ in LLAMA_STYLE and hasattr(m, "variance_epsilon"):
            m.forward = rms_norm.__get__(m)  # bound method: an instance attribute, per module
            swapped += 1
    return swapped
