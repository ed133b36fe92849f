"""Paged attention plugged into transformers' model code through its attention interface.

The runner flattens a step into one row of tokens `[1, T]`: first one decode token per running
sequence, then each prefill chunk. transformers runs the projections, RoPE and MLPs on the whole
row (that is the batching win); per layer it calls `paged_attention`, which writes the new K/V
into the pool and attends each sequence to its own cached context only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.kernels.cpu_kernels import Kernel

IMPLEMENTATION = "crowdchat_paged"


@dataclass
class PrefillChunk:
    """One sequence's prefill tokens `[start, end)` of the flat row."""

    start: int
    end: int
    context_slots: torch.Tensor | None  # [L] cached + new slots; None: no cached prefix
    mask: torch.Tensor | None  # [n, L] bool, causal with the cached prefix
    # for the CPU kernel instead of the two above: the sequence's blocks and how many of its
    # tokens come before the chunk
    blocks: torch.Tensor | None = None  # [nblk] int64
    cached: int = 0
    grouped: bool = False  # attended in one of the step's `prefill_groups` instead


@dataclass
class PrefillGroup:
    """Short prefill chunks attended in one call of the CPU kernel (`prefills_kernel`): rows
    `[start, end)` of the flat row, one chunk's tokens after another's."""

    start: int
    end: int
    blocks: torch.Tensor  # [C, nblk] int64: each chunk's sequence's blocks
    starts: torch.Tensor  # [C] int64: its sequence's tokens before each chunk
    sizes: torch.Tensor  # [C] int64: each chunk's tokens


@dataclass
class DecodeGroup:
    """Decode rows `[start, end)` of the flat row, of similar context lengths."""

    start: int
    end: int
    blocks: torch.Tensor  # [b, nblk] each decode's block table, padded to the group's longest
    pad: torch.Tensor | None  # [b, nblk * block_size] bool, True = not its context; None: none
    lens: torch.Tensor | None = None  # [b] int64 context lengths, for the CPU kernel


@dataclass
class StepMetadata:
    """What every layer's attention needs for one step, built once by the runner."""

    k_cache: list[torch.Tensor]  # per layer [H_kv, slots, D]
    v_cache: list[torch.Tensor]
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_groups: list[DecodeGroup]  # the decodes come first in the row, in these groups
    prefills: list[PrefillChunk]
    # the CPU kernel that reads decodes' K/V from their blocks (engine.kernels.cpu_kernels); None:
    # gather them (CUDA, or where it could not be built)
    decode_kernel: Kernel | None = None
    # its sibling for prefill chunks that carry `blocks`
    prefill_kernel: Kernel | None = None
    # the CPU's: many short chunks in one call (`prefill_groups`)
    prefills_kernel: Kernel | None = None
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    # a CPU step with prompt tokens run as one `crowdchat::prompt_stack` call: every row's block
    # table [T, nblk] and context length [T] (its own token included); None: op by op
    row_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    # CUDA, bfloat16 or float16 compute: RoPE with the K/V write in one launch
    # (triton_layer.rope_store), which the flat forward takes for steps of decodes only
    rope_store: Kernel | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor | None,  # [1, H_kv, T, D]; None: in the pool already (rope_store)
    value: torch.Tensor | None,  # [1, H_kv, T, D]; None with key
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    crowdchat: StepMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Write this step's K/V into the pool (unless `key` and `value` are None: written
    already), then attend per sequence. Returns `[1, T, H, D]`.
    A layer with a `sliding_window` (Mistral, Gemma) sees only that many last positions; one
    with `softcap` (Gemma 2) caps its scores as `softcap * tanh(s / softcap)`: these take the
    gathered path (the runner turns the CPU kernels off for such models, `needs_general`)."""
    meta = crowdchat
    assert meta is not None, "paged attention runs only inside the engine's model runner"
    special = Special(sliding_window or None, softcap or None)
    if special.any:
        assert meta.decode_kernel is None and meta.prefill_kernel is None
        assert not meta.prefill_groups
    layer = module.layer_idx
    kc, vc = meta.k_cache[layer], meta.v_cache[layer]
    if key is not None and value is not None:
        kc.index_copy_(1, meta.slot_mapping, key[0].to(kc.dtype))  # [H_kv, T, D]
        vc.index_copy_(1, meta.slot_mapping, value[0].to(vc.dtype))

    def from_pool(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at `slots`, `[1, H_kv, L, D]` in the query's dtype."""
        k, v = kc.index_select(1, slots), vc.index_select(1, slots)
        return k.unsqueeze(0).to(query.dtype), v.unsqueeze(0).to(query.dtype)

    def chunk_kv(c: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's own K/V `[1, H_kv, n, D]` as the pool stores them, in the query's dtype."""
        if key is None or value is None:  # read back: the same values `_as_stored` gives
            return from_pool(meta.slot_mapping[c.start : c.end])
        k, v = key[:, :, c.start : c.end], value[:, :, c.start : c.end]
        return _as_stored(k, kc.dtype), _as_stored(v, vc.dtype)

    _, h, t, d = query.shape
    out = query.new_empty(t, h, d)
    hkv, bs = kc.shape[0], meta.block_size
    scale = d**-0.5 if scaling is None else scaling  # for crowdchat's CPU kernels
    for g in meta.decode_groups:
        b, nblk = g.blocks.shape
        if meta.decode_kernel is not None:
            q = query[0, :, g.start : g.end].transpose(0, 1).float().contiguous()  # [b, H, D]
            out[g.start : g.end] = meta.decode_kernel(q, kc, vc, g.blocks, g.lens, bs, scale)
            continue
        # gather whole blocks with index_select: long row copies, ~5x faster on CPU than
        # advanced indexing
        blocks = g.blocks.flatten()
        k = kc.view(hkv, -1, bs, d).index_select(1, blocks).view(hkv, b, nblk * bs, d)
        v = vc.view(hkv, -1, bs, d).index_select(1, blocks).view(hkv, b, nblk * bs, d)
        # a bf16 pool beside float32 compute: SDPA in float32 (bf16 is 3-5x slower without
        # native bf16), after a gather of half the bytes
        k, v = k.to(query.dtype), v.to(query.dtype)
        if special.any:
            q = query[0, :, g.start : g.end].transpose(0, 1).unsqueeze(2)  # [b, H, 1, D]
            seen = torch.ones(b, nblk * bs, dtype=torch.bool, device=q.device)
            if g.pad is not None:
                seen = ~g.pad
            lens = seen.sum(1)  # the decode token is the last of each context
            allowed = special.window(seen[:, None, None, :], (lens - 1)[:, None, None, None])
            o = special.attend(q, k.transpose(0, 1), v.transpose(0, 1), allowed, scaling)
            out[g.start : g.end] = o[:, :, 0]
            continue
        out[g.start : g.end] = _decode_attention(query[0, :, g.start : g.end], k, v, g.pad, scaling)
    for pg in meta.prefill_groups:
        assert meta.prefills_kernel is not None
        q = query[0, :, pg.start : pg.end].transpose(0, 1).float().contiguous()  # [n, H, D]
        out[pg.start : pg.end] = meta.prefills_kernel(
            q, kc, vc, pg.blocks, pg.starts, pg.sizes, bs, scale
        )
    for c in meta.prefills:
        if c.grouped:
            continue
        if c.blocks is not None:
            assert meta.prefill_kernel is not None
            q = query[0, :, c.start : c.end].transpose(0, 1).float().contiguous()  # [n, H, D]
            out[c.start : c.end] = meta.prefill_kernel(q, kc, vc, c.blocks, c.cached, bs, scale)
            continue
        q = query[:, :, c.start : c.end]  # [1, H, n, D]
        if special.any:
            n = c.end - c.start
            if c.context_slots is None:
                k, v = chunk_kv(c)
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            else:
                k, v = from_pool(c.context_slots)
                mask = c.mask
            first = mask.shape[1] - n  # the chunk's first position
            rows = torch.arange(first, first + n, device=q.device)[:, None]  # [n, 1]
            o = special.attend(q, k, v, special.window(mask, rows), scaling)
            out[c.start : c.end] = o[0].transpose(0, 1)
            continue
        if c.context_slots is None:
            # as the pool stores them: the same K/V whether a prompt is prefilled in one
            # chunk, in several, or after a restored prefix
            k, v = chunk_kv(c)
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k, v = from_pool(c.context_slots)  # [1, H_kv, L, D]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=c.mask, scale=scaling, enable_gqa=True
            )
        out[c.start : c.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


@dataclass(frozen=True)
class Special:
    """A layer's sliding window and score cap, where it has them (None: none)."""

    sliding_window: int | None
    softcap: float | None

    @property
    def any(self) -> bool:
        return self.sliding_window is not None or self.softcap is not None

    def window(self, allowed: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """`allowed` [..., L] (key j at position j) narrowed to the keys within the window
        of queries at `query_pos` (broadcast against it): j > pos - window, as transformers'
        sliding-window masks have it."""
        if self.sliding_window is None:
            return allowed
        keys = torch.arange(allowed.shape[-1], device=allowed.device)
        return allowed & (keys > query_pos - self.sliding_window)

    def attend(
        self,
        q: torch.Tensor,  # [B, H, n, D]
        k: torch.Tensor,  # [B, H_kv, L, D]
        v: torch.Tensor,  # [B, H_kv, L, D]
        allowed: torch.Tensor,  # broadcasts to [B, H, n, L]; True: attend
        scaling: float | None,
    ) -> torch.Tensor:
        """Attention as transformers' eager code computes it for such a layer: scores,
        capped, masked, a float32 softmax. # [B, H, n, D]"""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


def needs_general(config: object) -> str | None:
    """Why a model's attention needs the gathered path (sliding windows, capped scores), or
    None: crowdchat's CPU kernels attend over whole contexts without a cap."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    if window and (not types or "sliding_attention" in types):
        return f"sliding-window attention ({window} positions)"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention scores"
    return None


def _as_stored(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded as a pool of `pool_dtype` stores it, in `x`'s dtype."""
    return x if x.dtype == pool_dtype else x.to(pool_dtype).to(x.dtype)


def _decode_attention(
    query: torch.Tensor,  # [H, B, D]
    k: torch.Tensor,  # [H_kv, B, Lmax, D]
    v: torch.Tensor,  # [H_kv, B, Lmax, D]
    pad: torch.Tensor | None,  # [B, Lmax]
    scaling: float | None,
) -> torch.Tensor:
    """One query token per sequence against its padded context.  # [B, H, D]

    One SDPA call, query heads grouped by their KV head (`enable_gqa`: K/V never expanded).
    On the 2-core AVX2 EPYC it took 39-48 us against 123-153 us for the two batched matmuls
    with a softmax between them that it replaced (1 row, context 208, float32), 160 against
    243 at context 1008, 249 against 312 at 8 rows and about the same at 32 rows.
    """
    mask = None if pad is None else ~pad[:, None, None, :]  # [B, 1, 1, Lmax], True: attend
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(2),  # [B, H, 1, D]
        k.transpose(0, 1),  # [B, H_kv, Lmax, D]
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out[:, :, 0]


def _no_mask(*args: object, **kwargs: object) -> None:
    """The paged attention builds its own masks from the step metadata."""
    return None


AttentionInterface.register(IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
