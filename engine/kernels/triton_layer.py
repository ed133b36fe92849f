"""A layer's small steps on CUDA in Triton, each one launch where PyTorch's tensor ops took
several: RoPE with the K/V write (`rope_store`) and the residual add with the RMSNorm after it
(`add_rms_norm`). At one user a decode step is launch-bound (~25 launches a layer, each a few
microseconds even inside a CUDA graph), so these count.

They serve bfloat16 and float16 compute (`used`: the CUDA path with the Triton attention), for
every step, prefills and decodes alike, so that a token's K/V are the same whichever step made
them. `rope_store` rounds as the tensor ops it replaces (bitwise); the norm sums its squares in
Triton's order, so its outputs are within rounding of `torch.rms_norm`'s, not bitwise (the KV
fingerprint names the path). On the CPU the tests run them under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_attention import available

HALF = (torch.bfloat16, torch.float16)


def used(cuda_attention: str, dtype: torch.dtype) -> bool:
    """Whether a model on this attention path and compute dtype runs these kernels."""
    return cuda_attention == "triton" and dtype in HALF and available()


if available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_store_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        stride_q,
        stride_k,
        stride_v,
        cos_ptr,  # [T, D] contiguous, compute dtype
        sin_ptr,
        kc_ptr,  # [H_kv, slots, D]
        vc_ptr,
        stride_kh,
        stride_ks,
        slots_ptr,  # [T] int64
        out_ptr,  # [T, H, D] float32: q after RoPE
        H: tl.constexpr,
        HKV: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
    ):
        """Program (token, head): heads [0, H) are q's, [H, H + H_kv) k's, then v's."""
        t, head = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, HALF_PAD)
        mask = i < HALF
        dt = q_ptr.dtype.element_ty
        if head < H + HKV:
            if head < H:
                src = q_ptr + t * stride_q + head * 2 * HALF
            else:
                src = k_ptr + t * stride_k + (head - H) * 2 * HALF
            x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
            c1 = tl.load(cos_ptr + t * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + t * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); the products of two
            # values of the compute dtype are exact in float32, then rounded as PyTorch does
            y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
            y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
            if head < H:
                dst = out_ptr + (t * H + head) * 2 * HALF
                tl.store(dst + i, y1.to(tl.float32), mask=mask)
                tl.store(dst + HALF + i, y2.to(tl.float32), mask=mask)
            else:
                slot = tl.load(slots_ptr + t)
                dst = kc_ptr + (head - H) * stride_kh + slot * stride_ks
                tl.store(dst + i, y1.to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + HALF + i, y2.to(kc_ptr.dtype.element_ty), mask=mask)
        else:
            src = v_ptr + t * stride_v + (head - H - HKV) * 2 * HALF
            slot = tl.load(slots_ptr + t)
            dst = vc_ptr + (head - H - HKV) * stride_kh + slot * stride_ks
            for half in range(2):
                x = tl.load(src + half * HALF + i, mask=mask, other=0.0)
                tl.store(dst + half * HALF + i, x.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr,  # [R, C]: the residual stream
        delta_ptr,  # [R, C]: what is added to it (ignored without ADD)
        w_ptr,  # [C]: the norm's weight
        h_out_ptr,  # [R, C]: h + delta (written with ADD)
        x_out_ptr,  # [R, C]: the normalized rows
        eps,
        C: tl.constexpr,
        C_PAD: tl.constexpr,
        ADD: tl.constexpr,
    ):
        """One row: h + delta rounded to the compute dtype (as PyTorch adds them), then
        weight * (h / rms(h)) as transformers' Llama computes it: the normalization in
        float32, cast back, times the weight in the compute dtype."""
        row = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        mask = c < C
        dt = h_ptr.dtype.element_ty
        h = tl.load(h_ptr + row * C + c, mask=mask, other=0.0)
        if ADD:
            d = tl.load(delta_ptr + row * C + c, mask=mask, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(dt)
            tl.store(h_out_ptr + row * C + c, h, mask=mask)
        hf = h.to(tl.float32)
        variance = tl.sum(hf * hf, axis=0) / C
        y = (hf * tl.rsqrt(variance + eps)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_out_ptr + row * C + c, (w * y).to(dt), mask=mask)


def rope_store(
    q: torch.Tensor,  # [T, H * D] rows of the projections (strided: slices of a fused output)
    k: torch.Tensor,  # [T, H_kv * D]
    v: torch.Tensor,  # [T, H_kv * D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [H_kv, slots, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64: where each token's K/V goes
    heads: int,
    kv_heads: int,
) -> torch.Tensor:  # [T, H, D] float32
    """RoPE on q and k and the K/V write into the pool in one launch (a step of decodes on
    CUDA: ~10 launches a layer before). Each product and the sum are rounded to the compute
    dtype (bfloat16 or float16) as `x * cos + rotate_half(x) * sin` rounds them in PyTorch, so
    q and the pool hold bitwise what the tensor ops gave; q comes back widened to float32, as
    the decode kernel takes it."""
    t, d = q.shape[0], k_cache.shape[2]
    assert q.dtype in HALF and k.dtype == v.dtype == q.dtype
    assert q.stride(1) == k.stride(1) == v.stride(1) == 1 and d % 2 == 0
    assert cos.shape == sin.shape == (t, d) and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    out = q.new_empty(t, heads, d, dtype=torch.float32)
    if t:
        _rope_store_kernel[(t, heads + 2 * kv_heads)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), cos.to(q.dtype), sin.to(q.dtype),
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), slots, out,
            H=heads, HKV=kv_heads, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return out


def add_rms_norm(
    h: torch.Tensor,  # [..., C]
    delta: torch.Tensor | None,  # [..., C] or None: normalize h as it is
    weight: torch.Tensor,  # [C]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, its RMSNorm) in one launch; (h, its RMSNorm) without delta."""
    c = h.shape[-1]
    assert h.dtype in HALF and weight.dtype == h.dtype and h.is_contiguous()
    rows = h.numel() // c
    x = torch.empty_like(h)
    out = h if delta is None else torch.empty_like(h)
    if delta is not None:
        assert delta.shape == h.shape and delta.dtype == h.dtype and delta.is_contiguous()
    if rows:
        _add_rms_norm_kernel[(rows,)](
            h, h if delta is None else delta, weight, out, x, eps,
            C=c, C_PAD=triton.next_power_of_2(c), ADD=delta is not None,
        )  # fmt: skip
    return out, x
