"""Llama's forward as one flat function over the model's own weights: the same ops, fewer calls.

A one-row decode step is mostly per-call overhead, not arithmetic (docs/PERFORMANCE.md, "Which
kernel runs where"): transformers' Llama goes through ~13 modules and their decorators per layer
(kwargs checks, output capture, mask building, `Module.__call__` hooks) and applies RoPE to q and k
separately, about 4,000 ATen calls a step on the embedded model. This runs the same arithmetic, op
for op, from the same weight tensors: the RMSNorms in one op as `engine.model.lean_norm` computes
them, RoPE as transformers writes it (`x * cos + rotate_half(x) * sin`) on q and k at once, the
engine's paged attention, the projections through the model's own (quantized) linear modules. Every
float is computed the same way, so its logits equal the transformers path's bitwise
(tests/test_lean_llama.py), and `generate` on the same model still gives the same tokens.

Only decoders that are exactly Llama's shape take it (`lean_forward` returns None otherwise:
biases, other activations or norms keep transformers' code). RoPE's cos/sin come from the
model's own rotary module, so its scaled variants (Llama 3's) are computed as transformers does.

A step of decodes only, where compute is float32 on the CPU with crowdchat's kernels built and
the projections on its 4-bit kernel (the CPU default without native bf16), goes further
(`_decodes`): up to `q4_rows` rows the whole step is one `crowdchat::decode_stack` call, each
layer a `decode_layer` that runs the kernels from C++, the rows split over the threads in one
parallel region; above, the fused q/k/v output goes straight into one `crowdchat::rope_store`
call (RoPE on q and k, the new K/V into the pool), then the paged attention op and the
projections' float16 dense copies: ~14 Python calls a layer instead of ~50. The same values
bitwise, and 1.6x faster at one row, 1.15x at eight (README "A decode step on the kernels").
Prefills and mixed steps there take `rope_store` and `silu_mul` too (`_cpu_attention`).

On CUDA with bfloat16 or float16 compute (engine.kernels.triton_layer), each residual add and
the norm after it are one Triton kernel, and a step of decodes takes RoPE and the K/V write as
one more, then the decode kernel (`_fused_attention`): the same values bitwise as the tensor
ops for RoPE and the K/V, within rounding for the norms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from engine.model.attention import StepMetadata, paged_attention
from engine.model.cpu_quant import Int4Linear
from engine.model.fused_proj import ProjectionPart
from engine.model.lean_norm import rms_norm

ARCHITECTURES = {"LlamaForCausalLM"}
Projections = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass
class Layer:
    attn: nn.Module  # its `layer_idx` and `scaling` are what paged attention reads
    norm1: nn.Module
    qkv: Projections
    o_proj: nn.Module
    norm2: nn.Module
    gate_up: Projections
    down: nn.Module
    # q/k/v (fused), o, gate/up (fused) and down on crowdchat's 4-bit kernel (engine.model.cpu_quant
    # `own`), for `_decodes`; None where one of them is not
    q4: tuple[Int4Linear, Int4Linear, Int4Linear, Int4Linear] | None


def _projections(linears: list[nn.Module]) -> Projections:
    """One callable for sibling projections: the fused kernel call when they are parts of one
    `FusedProjection` (engine.model.fused_proj), else each linear on its own."""
    parts = [m for m in linears if isinstance(m, ProjectionPart)]
    if len(parts) == len(linears) and len({id(p.fused) for p in parts}) == 1:
        return parts[0].fused.outputs
    return lambda x: tuple(m(x) for m in linears)


def _q4_linear(m: nn.Module, fused: bool) -> Int4Linear | None:
    """`m` (with `fused`: the whole fused group `m` is a part of) where it runs on crowdchat's
    4-bit kernel, else None."""
    if fused:
        if not isinstance(m, ProjectionPart):
            return None
        m = m.fused.linear
    return m if isinstance(m, Int4Linear) and m.own else None


def _q4_linears(layer: nn.Module) -> tuple[Int4Linear, ...] | None:
    """q/k/v, o, gate/up and down where all four run on crowdchat's 4-bit kernel, q/k/v and
    gate/up each one fused matrix; else None."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (
        _q4_linear(attn.q_proj, fused=True),
        _q4_linear(attn.o_proj, fused=False),
        _q4_linear(mlp.gate_proj, fused=True),
        _q4_linear(mlp.down_proj, fused=False),
    )
    return None if any(m is None for m in linears) else linears


class LeanLlama:
    """`forward(ids, positions, meta, logit_rows)` -> the logits of `logit_rows`."""

    def __init__(self, model: nn.Module) -> None:
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        # CUDA, bfloat16/float16: the residual add and the norm after it as one launch
        # (engine.kernels.triton_layer.add_rms_norm; the runner sets it), else tensor ops
        self.norm_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.layers = [
            Layer(
                attn=layer.self_attn,
                norm1=layer.input_layernorm,
                qkv=_projections(
                    [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
                ),
                o_proj=layer.self_attn.o_proj,
                norm2=layer.post_attention_layernorm,
                gate_up=_projections([layer.mlp.gate_proj, layer.mlp.up_proj]),
                down=layer.mlp.down_proj,
                q4=_q4_linears(layer),
            )
            for layer in inner.layers[: cfg.num_hidden_layers]  # as transformers runs them
        ]
        # steps of decodes only take `_decodes` where every layer's projections are on the
        # 4-bit kernel: up to `q4_rows` rows on the kernel itself, more (with `dense_above`) on
        # their dense copies (float16 on FBGEMM, else in the compute dtype)
        own = [m for layer in self.layers for m in layer.q4 or ()]
        self.q4_rows = 0
        self.dense_above = False
        if self.layers and all(layer.q4 is not None for layer in self.layers):
            self.q4_rows = min(m.dense_rows if m.dense is not None else 1 << 30 for m in own)
            self.dense_above = all(m.dense is not None for m in own)
        # up to `q4_rows` rows, all layers are one `crowdchat::decode_stack` call: its weights
        # (the op takes one eps: where the norms' differ, only the dense copies' path is taken)
        norms = [n for layer in self.layers for n in (layer.norm1, layer.norm2)]
        self.eps = norms[0].variance_epsilon if norms else 0.0
        if any(n.variance_epsilon != self.eps for n in norms):
            self.q4_rows = 0
        self.layer_weights: list[list[torch.Tensor]] = []
        for layer in self.layers if self.q4_rows else ():
            qkv, o_proj, gate_up, down = layer.q4
            self.layer_weights.append(
                [layer.norm1.weight, qkv.packed, qkv.scales_zeros, o_proj.packed]
                + [o_proj.scales_zeros, layer.norm2.weight, gate_up.packed]
                + [gate_up.scales_zeros, down.packed, down.scales_zeros]
            )
        self.stack_weights = [w for weights in self.layer_weights for w in weights]
        # `decode_stack` splits a few-row step's matmul columns over the threads (csrc/
        # decode_layer.cpp `decode_stack_shared`): one row pays for both cores there
        self.shared_decodes = bool(self.stack_weights) and bool(
            torch.ops.crowdchat.decode_stack_shares(self.stack_weights)
        )
        self.scaling = self.layers[0].attn.scaling if self.layers else 1.0
        if any(layer.attn.scaling != self.scaling for layer in self.layers):
            self.q4_rows = 0  # `decode_stack` takes one scale for every layer
        # and a step with prompt tokens of up to `q4_rows` rows can be one `prompt_stack` call
        self.prompt_stacks = self.shared_decodes and bool(self.q4_rows)
        self._own = own
        # False: every step takes `forward`'s general loop (benchmarks and tests compare them)
        self.kernel_decodes = bool(self.q4_rows) or self.dense_above
        # every layer's projections on crowdchat's 4-bit kernel: its CPU ops are built
        self.cpu_glue = bool(self.layers) and all(layer.q4 is not None for layer in self.layers)

    def forward(
        self,
        ids: torch.Tensor,  # [1, T]
        positions: torch.Tensor,  # [1, T]
        meta: StepMetadata,
        logit_rows: torch.Tensor,  # [N]
    ) -> torch.Tensor:  # [N, V]
        h = self.embed(ids)  # [1, T, C]
        cos, sin = self.rotary(h, positions)  # [1, T, D] each
        t = ids.shape[1]
        if (
            self.kernel_decodes
            and (t <= self.q4_rows or self.dense_above)
            and meta.decode_kernel is not None
            and meta.decode_groups
            and not meta.prefills
            and h.dtype == torch.float32
        ):
            h = self._decodes(h[0], cos[0], sin[0], meta)
            return self.lm_head(rms_norm(self.final_norm, h)[logit_rows])
        if (
            meta.row_tables is not None
            and ids.shape[1] <= self.prompt_stack_rows()
            and h.dtype == torch.float32
        ):
            h = self._prompt_stack(h[0], cos[0], sin[0], meta)
            return self.lm_head(rms_norm(self.final_norm, h)[logit_rows])
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        # CUDA, a step of decodes: RoPE, the K/V write and the attention in two launches a
        # layer (the same values bitwise: triton_layer.rope_store)
        fused = meta.rope_store is not None and meta.decode_kernel is not None
        fused = fused and not meta.prefills and len(meta.decode_groups) == 1
        rows = cos[0], sin[0]  # [T, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D]: broadcast over heads
        # the CPU's 4-bit kernels in float32, any step: RoPE with the K/V write in one C++ call
        # and SiLU with its product in another (the same values bitwise). In a prefill each of
        # the ~10 ATen calls they replace a layer was a parallel region waking the other core
        glue = self.cpu_glue and h.dtype == torch.float32 and h.device.type == "cpu"
        if glue:
            rows = rows[0].contiguous(), rows[1].contiguous()
        norms = [layer.norm1 for layer in self.layers] + [self.final_norm]  # each layer's first
        h, x = self._add_norm(norms[0], h, None)
        for layer, after in zip(self.layers, norms[1:], strict=True):
            cpu = glue and layer.q4 is not None and not layer.q4[0].uses_dense(x)
            if cpu:
                o = self._cpu_attention(layer, x, *rows, meta)  # [1, T, H, D]
            elif fused:
                q, k, v = layer.qkv(x)
                o = self._fused_attention(layer, q[0], k[0], v[0], *rows, meta)  # [T, H, D]
            else:
                q, k, v = layer.qkv(x)
                # RoPE on q and k in one pass (transformers' own formula and `rotate_half`)
                qk = torch.cat((q, k), dim=-1).view(t, nq + nkv, d)
                qk = qk * cos + rotate_half(qk) * sin
                query = qk[:, :nq].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
                key = qk[:, nq:].transpose(0, 1).unsqueeze(0)  # [1, H_kv, T, D]
                value = v.view(t, nkv, d).transpose(0, 1).unsqueeze(0)
                o, _ = paged_attention(
                    layer.attn, query, key, value, None, scaling=layer.attn.scaling, crowdchat=meta
                )  # [1, T, H, D]
            h, x = self._add_norm(layer.norm2, h, layer.o_proj(o.reshape(1, t, -1)))
            gate, up = layer.gate_up(x)
            if cpu:  # F.silu(gate) * up in one C++ call
                product = torch.ops.crowdchat.silu_mul(gate[0], up[0]).unsqueeze(0)
            else:
                product = F.silu(gate) * up
            h, x = self._add_norm(after, h, layer.down(product))
        return self.lm_head(x[:, logit_rows])[0]  # x: the final norm's rows

    def _add_norm(
        self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its RMSNorm by `norm`); without delta (h, its RMSNorm)."""
        if self.norm_kernel is not None and norm.weight.dtype == h.dtype:
            return self.norm_kernel(h, delta, norm.weight, norm.variance_epsilon)
        if delta is not None:
            h = h + delta
        return h, rms_norm(norm, h)

    def _cpu_attention(
        self,
        layer: Layer,
        x: torch.Tensor,  # [1, T, C]
        cos: torch.Tensor,  # [T, D] contiguous
        sin: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:  # [1, T, H, D]
        """A layer's attention on the CPU kernels for any step: the fused q/k/v output straight
        into `crowdchat::rope_store` (RoPE on q and k, the new K/V into the pool, bitwise the
        tensor ops and `index_copy_`), then `paged_attention` with the K/V already stored."""
        assert layer.q4 is not None
        i = layer.attn.layer_idx
        qkv = layer.q4[0](x)  # [1, T, (H + 2 H_kv) D]: what `layer.qkv` splits
        query = torch.ops.crowdchat.rope_store(
            qkv[0], cos, sin, meta.k_cache[i], meta.v_cache[i], meta.slot_mapping,
            self.heads, self.kv_heads,
        )  # fmt: skip
        o, _ = paged_attention(
            layer.attn,
            query.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            None,
            None,
            None,
            scaling=layer.attn.scaling,
            crowdchat=meta,
        )
        return o

    def _fused_attention(
        self,
        layer: Layer,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, H_kv * D]
        v: torch.Tensor,
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:  # [T, H, D] in the compute dtype
        """A decode step's attention for one layer as `paged_attention` computes it, RoPE and
        the K/V write fused (`meta.rope_store`), the rows one decode group."""
        assert meta.rope_store is not None and meta.decode_kernel is not None
        i, group = layer.attn.layer_idx, meta.decode_groups[0]
        kc, vc = meta.k_cache[i], meta.v_cache[i]
        query = meta.rope_store(
            q, k, v, cos, sin, kc, vc, meta.slot_mapping, self.heads, self.kv_heads
        )  # [T, H, D] float32
        scale = self.head_dim**-0.5 if layer.attn.scaling is None else layer.attn.scaling
        return meta.decode_kernel(
            query, kc, vc, group.blocks, group.lens, meta.block_size, scale, out_dtype=q.dtype
        )  # the Triton kernel's: with the rope_store hook, only it is set

    def prompt_stack_rows(self) -> int:
        """The most rows a step with prompt tokens may take in one `prompt_stack` call (0:
        none): `q4_rows`, and no more than where `--cpu-bf16-above` puts a linear on the bf16
        GEMM (which the op-by-op loop would then take)."""
        if not self.prompt_stacks:
            return 0
        wide = [m.bf16_rows for m in self._own if getattr(m, "bf16_rows", 0)]
        return min([self.q4_rows, *wide])

    def _prompt_stack(
        self,
        h: torch.Tensor,  # [T, C]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:  # [T, C]
        """A step with prompt tokens (the runner's `row_tables`) in one
        `crowdchat::prompt_stack` call: as `decode_stack` runs a few-row decode step, each
        token a row of its own context; bitwise `forward`'s loop (tests/test_lean_llama.py)."""
        assert meta.row_tables is not None
        op = torch.ops.crowdchat.prompt_stack.default
        return self._stack(op, h, cos, sin, meta, *meta.row_tables)

    def _stack(
        self,
        op: Callable[..., torch.Tensor],
        h: torch.Tensor,  # [T, C]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: StepMetadata,
        blocks: torch.Tensor,  # [T, nblk]: each row's block table
        lens: torch.Tensor,  # [T]: each row's context length, its own token included
    ) -> torch.Tensor:  # [T, C]
        """Every layer in one call of `op` (`decode_stack` or `prompt_stack`)."""
        k_caches = [meta.k_cache[layer.attn.layer_idx] for layer in self.layers]
        v_caches = [meta.v_cache[layer.attn.layer_idx] for layer in self.layers]
        return op(
            h, self.stack_weights, self.eps, cos.contiguous(), sin.contiguous(), k_caches,
            v_caches, meta.slot_mapping, blocks, lens, meta.block_size, self.scaling,
            self.heads, self.kv_heads,
        )  # fmt: skip

    def _decodes(
        self,
        h: torch.Tensor,  # [T, C]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:  # [T, C]
        """A step of decodes only, float32, on crowdchat's CPU kernels. Up to `q4_rows` rows
        the step is one `crowdchat::decode_stack` call (`engine/kernels/csrc/decode_layer.cpp`: the
        kernels below called from C++ layer after layer, the rows split over the threads);
        above, ~14 Python calls a layer instead of the loop's
        ~50, the projections on their dense copies. The same ops on the same values as
        `forward`'s loop (RoPE and the K/V write as `crowdchat::rope_store` computes them,
        bitwise as in Python), so the logits and the K/V are bitwise the same
        (tests/test_lean_llama.py); what goes is the calls' overhead, at few rows most of a
        step's time beside the weights' kernel."""
        ops = torch.ops.crowdchat
        rope_store, attend = ops.rope_store.default, ops.paged_decode_attention.default
        silu_mul = ops.silu_mul.default
        (group,) = meta.decode_groups  # the CPU kernel takes all decodes as one group
        t, nq, nkv, bs = h.shape[0], self.heads, self.kv_heads, meta.block_size
        cos, sin = cos.contiguous(), sin.contiguous()
        if t <= self.q4_rows:  # every layer in one call, its rows split over the threads
            return self._stack(
                ops.decode_stack.default, h, cos, sin, meta, group.blocks, group.lens
            )

        for layer in self.layers:  # the dense copies, called as `forward`'s loop calls them
            kc, vc = meta.k_cache[layer.attn.layer_idx], meta.v_cache[layer.attn.layer_idx]
            x = rms_norm(layer.norm1, h)
            q = rope_store(
                torch.cat(layer.qkv(x), -1), cos, sin, kc, vc, meta.slot_mapping, nq, nkv
            )
            o = attend(q, kc, vc, group.blocks, group.lens, bs, layer.attn.scaling)
            h = h + layer.o_proj(o.view(t, -1))
            x = rms_norm(layer.norm2, h)
            gate, up = layer.gate_up(x)
            h = h + layer.down(silu_mul(gate, up))
        return h


def fits(model: nn.Module) -> bool:
    """Whether `model`'s decoder is exactly Llama's (the flat forward runs it)."""
    cfg = model.config
    return not (
        type(model).__name__ not in ARCHITECTURES
        or getattr(cfg, "attention_bias", False)
        or getattr(cfg, "mlp_bias", False)
        or cfg.hidden_act != "silu"
        or any(type(m).__name__ != "LlamaRMSNorm" for m in _norms(model))
    )


def lean_forward(model: nn.Module) -> LeanLlama | None:
    """The flat forward for `model`, or None where its decoder is not exactly Llama's."""
    return LeanLlama(model) if fits(model) else None


def _norms(model: nn.Module) -> list[nn.Module]:
    """The norms the flat forward runs: the final one and those of its layers."""
    inner = model.model
    layers = inner.layers[: model.config.num_hidden_layers]
    return [inner.norm] + [
        n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
