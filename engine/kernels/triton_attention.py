"""Paged attention for CUDA in Triton: each decode row reads its own blocks of the KV pool
through its block table inside the kernel, split over the context (flash-decoding).

The CUDA path gathered each length group's blocks into a dense copy and called SDPA with a
pad mask: a copy of the context a step, a group per ~25% of context spread, and shapes that
change every step (nothing a CUDA graph can hold). Here one launch serves every decode row:

- grid (rows, KV heads, splits): a program takes one row's one KV head and `split_blocks`
  blocks of its context, the KV head's query heads together (GQA: K/V read once for the
  group), an online softmax in float32 over the blocks, and writes its partial max, sum and
  output; a second kernel (grid rows x query heads) merges the splits, as flash-decoding
  does (a dozen tensor ops did, a dozen launches a layer);
- the launch shape depends only on the rows and the block table's width, not on the
  contexts' lengths, and the compiled kernel only on the model's shape and the block size
  (Triton compiles one per set of `constexpr`s): blocks past a row's length are skipped
  inside the kernel, a row of length 0 (a padded row of a batch bucket) writes zeros; so a
  step of a fixed bucket can be captured;
- a short prefill chunk after cached tokens is the same kernel, one row per chunk token with
  the sequence's table and the token's own causal length (`paged_prefill_attention`).

`paged_decode_attention` and `paged_prefill_attention` have the signatures of crowdchat's CPU
kernels (engine.kernels.cpu_kernels), so the runner plugs them into the same hooks. On the CPU
the tests run them under `TRITON_INTERPRET=1` against the reference attention (float32 and
float16 pools: the interpreter reads bfloat16 wrongly); tests/test_cuda.py runs them on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

SPLIT_TOKENS = 512  # context tokens per program: long conversations spread over more programs


def available() -> bool:
    """Whether Triton is installed (it ships with PyTorch's CUDA builds)."""
    return importlib.util.find_spec("triton") is not None


if available():
    import triton
    import triton.language as tl

    @triton.jit
    def _split_kernel(
        q_ptr,  # [B, H, D]
        k_ptr,  # [H_kv, slots, D]
        v_ptr,
        table_ptr,  # [B, nblk] int64
        lens_ptr,  # [B] int64
        m_ptr,  # [B, H, S] float32: each split's running max
        l_ptr,  # [B, H, S] float32: its sum of exponentials
        acc_ptr,  # [B, H, S, D] float32: its unnormalized output
        scale,
        stride_qb,
        stride_qh,
        stride_kh,
        stride_ks,
        stride_tb,
        splits,
        split_blocks,  # blocks a split: a runtime value, so every bucket's split size (engine.
        # model.static_decode.split_tokens) shares one compiled kernel
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lens_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        heads = kvh * GROUP + g
        d = tl.arange(0, D_PAD)
        hmask, dmask = g < GROUP, d < D
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.full([GROUP_PAD], 0.0, tl.float32)
        acc = tl.full([GROUP_PAD, D_PAD], 0.0, tl.float32)
        offs = tl.arange(0, BLOCK)
        for i in range(split_blocks):  # blocks past the row's end skipped
            index = split * split_blocks + i
            if index * BLOCK < length:
                block = tl.load(table_ptr + row * stride_tb + index)
                valid = index * BLOCK + offs < length
                where = kvh * stride_kh + (block * BLOCK + offs)[:, None] * stride_ks + d[None, :]
                kv_mask = valid[:, None] & dmask[None, :]
                k = tl.load(k_ptr + where, mask=kv_mask, other=0.0).to(tl.float32)
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK]
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                v = tl.load(v_ptr + where, mask=kv_mask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                total = total * alpha + tl.sum(p, axis=1)
                m = m_new
        # a split past the row's end (and every split of a padded row) writes nothing: the
        # merge reads only the splits that hold tokens
        out = (row * GROUP * tl.num_programs(1) + heads) * splits + split
        used = hmask & (g * 0 + split * split_blocks * BLOCK < length)  # [GROUP_PAD]
        tl.store(m_ptr + out, m, mask=used)
        tl.store(l_ptr + out, total, mask=used)
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=used[:, None] & dmask[None, :])

    @triton.jit
    def _merge_kernel(
        m_ptr,  # [B, H, S] float32, as _split_kernel left them
        l_ptr,
        acc_ptr,  # [B, H, S, D]
        out_ptr,  # [B, H, D] float32
        lens_ptr,  # [B] int64
        splits,
        split_len,  # tokens a split
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
    ):
        """One row's one query head: the partial results of its splits that hold tokens (the
        others were never written) weighed by exp(max - the top max) and normalized; a row
        with no token gives 0."""
        item = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        length = tl.load(lens_ptr + tl.program_id(0))
        s = tl.arange(0, S_PAD)
        smask = (s < splits) & (s * split_len < length)
        m = tl.load(m_ptr + item * splits + s, mask=smask, other=float("-inf"))
        total = tl.load(l_ptr + item * splits + s, mask=smask, other=0.0)
        seen = total > 0
        top = tl.max(tl.where(seen, m, float("-inf")), axis=0)
        top = tl.where(top > float("-inf"), top, 0.0)  # no token at all: any finite value
        weight = tl.where(seen, tl.exp(tl.where(seen, m, top) - top), 0.0)
        norm = tl.sum(weight * total, axis=0)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        acc = tl.load(
            acc_ptr + (item * splits + s)[:, None] * D + d[None, :],
            mask=smask[:, None] & dmask[None, :],
            other=0.0,
        )
        out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(norm > 0, norm, 1.0)
        tl.store(out_ptr + item * D + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [H_kv, slots, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, nblk] int64
    context_lens: torch.Tensor,  # [B] int64
    block_size: int,
    scale: float,
    split_tokens: int = SPLIT_TOKENS,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Each row's query heads against its own first `context_lens` tokens in the pool's
    blocks; [B, H, D] in `out_dtype` (float32, or the compute dtype: rounded as `.to` would
    round it, one launch fewer). The launch depends on B, the table's width and `split_tokens`
    only."""
    b, h, d = q.shape
    hkv, nblk = k_cache.shape[0], block_table.shape[1]
    assert h % hkv == 0 and k_cache.shape[2] == d and k_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and q.stride(2) == 1
    group = h // hkv
    # fixed per model (not the table's width): one compiled kernel serves every step
    split_blocks = max(1, split_tokens // block_size)
    splits = max(1, -(-nblk // split_blocks))
    m = q.new_empty(b, h, splits, dtype=torch.float32)
    total = torch.empty_like(m)
    acc = q.new_empty(b, h, splits, d, dtype=torch.float32)
    if b == 0:
        return acc[:, :, 0].to(out_dtype)
    _split_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        m,
        total,
        acc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        splits,
        split_blocks,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        D=d,
        D_PAD=triton.next_power_of_2(d),
        BLOCK=block_size,
    )
    out = q.new_empty(b, h, d, dtype=out_dtype)
    _merge_kernel[(b, h)](
        m, total, acc, out, context_lens, splits, split_blocks * block_size, D=d,
        D_PAD=triton.next_power_of_2(d), S_PAD=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out


def self_check(
    device: torch.device, kv_dtype: torch.dtype, head_dim: int, group: int
) -> str | None:
    """Runs the decode kernel once on a tiny pool on `device` (float32 queries, as the steps
    pass them; the pool's dtype, the model's head size and GQA group) against dense softmax
    attention: None when it agrees, else why not. A GPU whose Triton cannot build or run the
    kernel then starts on the gathered attention instead of failing (engine.model.loader)."""
    try:
        gen = torch.Generator().manual_seed(0)
        bs, blocks = 16, 4
        k, v = (torch.randn(1, blocks * bs, head_dim, generator=gen).to(kv_dtype) for _ in "kv")
        q = torch.randn(2, group, head_dim, generator=gen)
        table, lens = torch.tensor([[2, 0], [1, 3]]), torch.tensor([bs + 3, 2 * bs])
        scale = head_dim**-0.5
        got = paged_decode_attention(
            q.to(device), k.to(device), v.to(device), table.to(device), lens.to(device), bs, scale
        ).cpu()
        for r in range(2):
            slots = torch.cat([torch.arange(bs) + int(b) * bs for b in table[r]])[: lens[r]]
            kr, vr = k[0, slots].float(), v[0, slots].float()
            want = ((q[r].float() @ kr.T) * scale).softmax(-1) @ vr  # [group, D]
            err = float((got[r] - want).abs().max())
            if not err <= 2e-2:  # the pool's own rounding is far below; NaN fails too
                return f"off by {err:.3g} from dense attention"
    except Exception as e:  # noqa: BLE001 - any failure to build or run is the answer
        return f"{type(e).__name__}: {e}"[:300]
    return None


def paged_prefill_attention(
    q: torch.Tensor,  # [n, H, D]: a chunk's tokens, after `cached` tokens of its sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [nblk] int64: the sequence's blocks (the chunk's K/V written)
    cached: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk after cached tokens, causal: token i sees the first cached + i + 1
    tokens; the decode kernel with one row per token sharing one table (stride 0)."""
    n = q.shape[0]
    table = blocks[None, :].expand(n, -1)
    lens = torch.arange(cached + 1, cached + n + 1, device=q.device)
    return paged_decode_attention(q, k_cache, v_cache, table, lens, block_size, scale)
