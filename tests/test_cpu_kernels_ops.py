"""The steps' glue ops on crowdchat's CPU kernels: `rope_store`, `round_to_bf16` and
`silu_mul` bitwise what Python and ATen compute, and bad inputs refused (the whole layer's
bitwise equality is tests/test_lean_llama.py's)."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.mark.parametrize("seed", range(4))
def test_rope_store_equals_rope_and_index_copy_in_python_bitwise(kernel, seed: int) -> None:
    """`crowdchat::rope_store` against transformers' RoPE (`x * cos + rotate_half(x) * sin`)
    and the pool write as engine.model.attention does it, on seeded shapes and pool dtypes."""
    from transformers.models.llama.modeling_llama import rotate_half

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(5):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        hkv, group, d = rng.choice([1, 2, 3]), rng.choice([1, 3, 4]), rng.choice([32, 64, 128])
        t, slots_n = rng.randint(1, 9), 64
        h = hkv * group
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen) * rng.choice([0.01, 1.0, 30.0])
        angles = torch.rand(t, d // 2, generator=gen) * 100
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        slots = torch.randperm(slots_n, generator=gen)[:t]
        kc, vc = (torch.zeros(hkv, slots_n, d, dtype=dtype) for _ in range(2))
        q = torch.ops.crowdchat.rope_store(qkv, cos, sin, kc, vc, slots, h, hkv)
        qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
        ref_k.index_copy_(1, slots, qk[:, h:].transpose(0, 1).to(dtype))
        ref_v.index_copy_(
            1, slots, qkv[:, (h + hkv) * d :].view(t, hkv, d).transpose(0, 1).to(dtype)
        )
        assert torch.equal(q, qk[:, :h])
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        with pytest.raises(RuntimeError, match="slot out of range"):
            bad = slots.clone()
            bad[-1] = slots_n
            torch.ops.crowdchat.rope_store(qkv, cos, sin, kc, vc, bad, h, hkv)
        with pytest.raises(RuntimeError, match="qkv"):
            torch.ops.crowdchat.rope_store(qkv[:, 1:], cos, sin, kc, vc, slots, h, hkv)


def test_the_layer_and_norm_ops_refuse_bad_inputs(kernel) -> None:
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.crowdchat.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crowdchat.rms_norm(x.double(), w, 1e-5)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match="10 tensors"):
        torch.ops.crowdchat.decode_layer(
            x, [w], 1e-5, x, x, empty, empty, empty, empty, empty, 16, 1.0, 1, 1
        )


@pytest.mark.parametrize("seed", range(3))
def test_round_to_bf16_equals_atens_casts_bitwise(kernel, seed: int) -> None:
    """Every float32 bit pattern kind (random bits: normals, subnormals, inf, NaN; values across
    the whole range; ties), out of place and in place, at sizes either side of the thread grain;
    a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(seed)
    n = [7, 1000, (1 << 17) + 3][seed]
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    ties = torch.randint(0, 2**15, (n,), generator=gen, dtype=torch.int64) << 16 | 0x8000
    for x in (
        bits.to(torch.int32).view(torch.float32),
        ties.to(torch.int32).view(torch.float32),
        torch.randn(n, generator=gen) * torch.logspace(-40, 38, n),
        torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-45]),
    ):
        ref = x.to(torch.bfloat16).to(torch.float32)
        for out in (
            torch.ops.crowdchat.round_to_bf16(x),
            torch.ops.crowdchat.round_to_bf16_(x.clone()),
        ):
            nan = ref.isnan()
            assert torch.equal(out.isnan(), nan)
            assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crowdchat.round_to_bf16(torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.crowdchat.round_to_bf16_(torch.ones(4, 4).t())


def test_silu_mul_equals_f_silu_times_up_bitwise(kernel) -> None:
    """On slices of one fused output (as the layers pass them) and on separate tensors."""
    gen = torch.Generator().manual_seed(0)
    for rows, inner in ((1, 1536), (33, 1536), (5, 7)):
        gu = torch.randn(rows, 2 * inner, generator=gen) * 4
        for gate, up in ((gu[:, :inner], gu[:, inner:]), (gu[:, inner:].clone(), gu[:, :inner])):
            ref = torch.nn.functional.silu(gate) * up
            assert torch.equal(torch.ops.crowdchat.silu_mul(gate, up), ref)
    with pytest.raises(RuntimeError, match="gate, up"):
        torch.ops.crowdchat.silu_mul(torch.ones(2, 5), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="gate, up"):
        torch.ops.crowdchat.silu_mul(torch.ones(5, 2).t(), torch.ones(2, 5))
