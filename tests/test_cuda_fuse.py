"""q/k/v and gate/up fused as one bitsandbytes 4-bit linear each (engine/model/fused_proj.py
`fuse_bnb_4bit`, the CUDA path's `--quant nf4`), checked here on bitsandbytes' CPU backend: the
fused matrix's dequantized weights are bitwise its parts', its outputs the parts' outputs, and
groups it cannot fuse exactly are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from engine.model.fused_proj import FusedProjection, ProjectionPart, fuse_bnb_4bit  # noqa: E402


def quantized(k: int, n: int, gen: torch.Generator, nested: bool = False) -> nn.Module:
    """A bias-free nf4 Linear4bit of random float32 weights, quantized on the CPU."""
    linear = bnb.nn.Linear4bit(
        k, n, bias=False, compute_dtype=torch.float32, compress_statistics=nested, quant_type="nf4"
    )
    weight = torch.randn(n, k, generator=gen) * 0.1
    linear.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, compress_statistics=nested, quant_type="nf4"
    )
    return linear.to("cpu")


def dequantized(linear: nn.Module) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(linear.weight.data, linear.weight.quant_state)


def layer(k: int, gen: torch.Generator, nested: bool = False) -> nn.Module:
    """A module with q/k/v (GQA widths) and gate/up, as a decoder layer's attention and MLP."""
    m = nn.Module()
    for name, n in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64), ("gate_proj", 192)):
        setattr(m, name, quantized(k, n, gen, nested))
    m.up_proj = quantized(k, 192, gen, nested)
    return m


def test_fused_4bit_projections_are_their_parts_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    m = layer(128, gen)
    parts = {n: getattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    assert parts["q_proj"].weight.quant_state is not None  # quantized on the CPU
    x = torch.randn(5, 128, generator=gen)
    want = {n: p(x) for n, p in parts.items()}
    assert fuse_bnb_4bit(m) == 2
    assert all(isinstance(getattr(m, n), ProjectionPart) for n in parts)
    qkv, gate_up = m.q_k_v, m.gate_up
    assert isinstance(qkv, FusedProjection) and qkv.sizes == [128, 64, 64]
    assert torch.equal(
        dequantized(qkv.linear),
        torch.cat([dequantized(parts[n]) for n in ("q_proj", "k_proj", "v_proj")]),
    )
    assert torch.equal(
        dequantized(gate_up.linear),
        torch.cat([dequantized(parts[n]) for n in ("gate_proj", "up_proj")]),
    )
    for n in parts:  # transformers' call order on one input
        torch.testing.assert_close(getattr(m, n)(x), want[n], rtol=1e-5, atol=1e-5)
    q, k, v = qkv.outputs(x)  # the lean forward's one call
    torch.testing.assert_close(
        torch.cat([q, k, v], -1),
        torch.cat([want["q_proj"], want["k_proj"], want["v_proj"]], -1),
        rtol=1e-5,
        atol=1e-5,
    )


def test_groups_that_cannot_fuse_exactly_stay_as_they_are() -> None:
    gen = torch.Generator().manual_seed(1)
    nested = layer(128, gen, nested=True)  # double-quantized scales: per-matrix offsets
    assert fuse_bnb_4bit(nested) == 0 and type(nested.q_proj) is bnb.nn.Linear4bit
    odd = layer(96, gen)  # rows that straddle the 64-value blocks
    assert fuse_bnb_4bit(odd) == 0 and type(odd.gate_proj) is bnb.nn.Linear4bit
    mixed = layer(128, gen)
    mixed.k_proj = nn.Linear(128, 64, bias=False)  # one part not 4-bit
    assert fuse_bnb_4bit(mixed) == 1 and type(mixed.q_proj) is bnb.nn.Linear4bit
