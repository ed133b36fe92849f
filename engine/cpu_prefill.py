"""On CPU, large prefill matmuls run faster on dequantized bf16 weights than in bitsandbytes'
4-bit kernel; small (decode) ones do not. This routes each nf4 linear accordingly.

Measured on the 2-core CPU for a 512-row input (SmolLM2 MLP): dequantize 60-120 us + bf16
matmul ~980 us, against ~1450-1640 us in `gemv_4bit`. Below ~128 rows bitsandbytes' kernel is
as fast or faster, so decode steps keep it. The dequantized weight lives only for the call:
memory stays quantized.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
PREFILL_ROWS = 128  # inputs with at least this many rows take the dequantize + matmul path


def _route(module: torch.nn.Module) -> None:
    import bitsandbytes.functional as bnbf

    packed_forward = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] < PREFILL_ROWS:
            return packed_forward(x)
        weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
        return F.linear(x, weight.to(x.dtype), module.bias)

    module.forward = forward


def route_prefill_matmuls(model: torch.nn.Module) -> int:
    """Patch every 4-bit linear of a CPU model whose quant state can be dequantized and whose
    result agrees with bitsandbytes' own; returns how many were patched."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    patched = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        qs = getattr(module.weight, "quant_state", None)
        if qs is None or getattr(qs, "packing_format_for_cpu", False):
            continue  # a packed CPU layout: only bitsandbytes' kernel reads it
        if patched == 0 and not _agrees(module):
            log.warning("dequantized prefill disagrees with bitsandbytes; not used")
            return 0
        _route(module)
        patched += 1
    if patched:
        log.info("CPU prefill: %d nf4 linears use dequantize + bf16 matmul for >= %d rows",
                 patched, PREFILL_ROWS)
    return patched


@torch.inference_mode()
def _agrees(module: torch.nn.Module) -> bool:
    import bitsandbytes.functional as bnbf

    x = torch.randn(PREFILL_ROWS, module.in_features, dtype=module.compute_dtype or
                    torch.bfloat16, generator=torch.Generator().manual_seed(0))
    ref = module(x).float()
    weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
    got = F.linear(x, weight.to(x.dtype), module.bias).float()
    return bool(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) < 0.02)
