"""The CUDA path's per-layer Triton kernels (engine/kernels/triton_layer.py), run on the CPU by
Triton's interpreter (`TRITON_INTERPRET=1`, tests/conftest.py) in float16 (the interpreter
reads bfloat16 wrongly; tests/test_cuda.py runs bfloat16 on a GPU): RoPE with the K/V write
bitwise as the tensor ops, the residual add bitwise and its RMSNorm within rounding of
`torch.rms_norm`, every row on its own."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from engine.kernels import triton_attention, triton_layer

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", range(3))
def test_rope_store_rounds_as_the_tensor_ops_and_writes_only_its_slots(seed: int) -> None:
    """RoPE with the K/V write in one kernel: q bitwise `x * cos + rotate_half(x) * sin` in
    the compute dtype (float16 here: the interpreter reads bfloat16 wrongly; a GPU runs
    bfloat16 in tests/test_cuda.py), the pool bitwise what `index_copy_` of the same K and V
    gives, every other slot untouched; q, k, v strided slices of one fused output."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    heads, kv_heads = rng.choice([(9, 3), (4, 4), (8, 2)])
    d, t, dtype = rng.choice([64, 48, 16]), rng.randint(1, 6), torch.float16
    fused = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    angle = torch.rand(t, d // 2, generator=gen) * 100
    cos = torch.cat([angle.cos()] * 2, dim=1).to(dtype)
    sin = torch.cat([angle.sin()] * 2, dim=1).to(dtype)
    pool_dtype = rng.choice([torch.float16, torch.float32])
    kc, vc = (torch.randn(kv_heads, 40, d, generator=gen).to(pool_dtype) for _ in "kv")
    slots = torch.randperm(40, generator=gen)[:t]
    want_k, want_v = kc.clone(), vc.clone()
    qk = torch.cat((q, k), dim=1).view(t, heads + kv_heads, d)
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    want_k.index_copy_(1, slots, qk[:, heads:].transpose(0, 1).to(pool_dtype))
    want_v.index_copy_(1, slots, v.view(t, kv_heads, d).transpose(0, 1).to(pool_dtype))
    got = triton_layer.rope_store(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
        kc := kc.to(DEVICE), vc := vc.to(DEVICE), slots.to(DEVICE), heads, kv_heads,
    )  # fmt: skip
    assert got.dtype == torch.float32 and got.shape == (t, heads, d)
    assert torch.equal(got.cpu(), qk[:, :heads].float())
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("seed", range(4))
def test_add_rms_norm_adds_as_pytorch_and_normalizes_each_row_on_its_own(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows, c, dtype = rng.randint(1, 9), rng.choice([576, 64, 100, 2048]), torch.float16
    h = (torch.randn(1, rows, c, generator=gen) * 3).to(dtype)
    delta = torch.randn(1, rows, c, generator=gen).to(dtype)
    weight = (1 + torch.randn(c, generator=gen) / 4).to(dtype)
    eps = rng.choice([1e-5, 1e-6])
    summed, x = triton_layer.add_rms_norm(h.to(DEVICE), delta.to(DEVICE), weight.to(DEVICE), eps)
    assert torch.equal(summed.cpu(), h + delta)  # the residual add, rounded as PyTorch does
    s = (h + delta).double()
    want = weight.double() * s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    # the normalization and the weight's product are each rounded to float16: 2 roundings
    torch.testing.assert_close(x.cpu().double(), want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(
        x.cpu(), weight * torch.rms_norm(s.float(), (c,), None, eps).to(dtype), rtol=1e-3, atol=2e-3
    )
    # without delta: h itself, normalized the same way; a row alone as in the batch
    same, alone = triton_layer.add_rms_norm(
        summed[:, :1].contiguous(), None, weight.to(DEVICE), eps
    )
    assert torch.equal(same.cpu(), summed[:, :1].cpu()) and torch.equal(alone.cpu(), x[:, :1].cpu())
