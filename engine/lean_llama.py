"""Llama's forward as one flat function over the model's own weights: the same ops, fewer calls.

A one-row decode step is mostly per-call overhead, not arithmetic (README "Which kernel runs
where"): transformers' Llama goes through ~13 modules and their decorators per layer (kwargs
checks, output capture, mask building, `Module.__call__` hooks) and applies RoPE to q and k
separately, about 4,000 ATen calls a step on the embedded model. This runs the same arithmetic,
op for op, from the same weight tensors: the RMSNorms in one op as `engine.lean_norm` computes
them, RoPE as transformers writes it (`x * cos + rotate_half(x) * sin`) on q and k at once, the
engine's paged attention, the projections through the model's own (quantized) linear modules.
Every float is computed the same way, so its logits equal the transformers path's bitwise
(tests/test_lean_llama.py), and `generate` on the same model still gives the same tokens.

Only decoders that are exactly Llama's shape take it (`lean_forward` returns None otherwise:
biases, other activations or norms keep transformers' code). RoPE's cos/sin come from the
model's own rotary module, so its scaled variants (Llama 3's) are computed as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from engine.attention import StepMetadata, paged_attention
from engine.fused_proj import ProjectionPart
from engine.lean_norm import rms_norm

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


def _projections(linears: list[nn.Module]) -> Projections:
    """One callable for sibling projections: the fused kernel call when they are parts of one
    `FusedProjection` (engine.fused_proj), else each linear on its own."""
    parts = [m for m in linears if isinstance(m, ProjectionPart)]
    if len(parts) == len(linears) and len({id(p.fused) for p in parts}) == 1:
        return parts[0].fused.outputs
    return lambda x: tuple(m(x) for m in linears)


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
            )
            for layer in inner.layers[: cfg.num_hidden_layers]  # as transformers runs them
        ]

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
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D]: broadcast over heads
        for layer in self.layers:
            x = rms_norm(layer.norm1, h)
            q, k, v = layer.qkv(x)
            # RoPE on q and k in one pass (transformers' own formula and `rotate_half`)
            qk = torch.cat((q, k), dim=-1).view(t, nq + nkv, d)
            qk = qk * cos + rotate_half(qk) * sin
            query = qk[:, :nq].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            key = qk[:, nq:].transpose(0, 1).unsqueeze(0)  # [1, H_kv, T, D]
            value = v.view(t, nkv, d).transpose(0, 1).unsqueeze(0)
            o, _ = paged_attention(
                layer.attn, query, key, value, None, scaling=layer.attn.scaling, crowdchat=meta
            )
            h = h + layer.o_proj(o.reshape(1, t, -1))
            x = rms_norm(layer.norm2, h)
            gate, up = layer.gate_up(x)
            h = h + layer.down(F.silu(gate) * up)
        h = rms_norm(self.final_norm, h)
        return self.lm_head(h[:, logit_rows])[0]


def lean_forward(model: nn.Module) -> LeanLlama | None:
    """The flat forward for `model`, or None where its decoder is not exactly Llama's."""
    cfg = model.config
    if (
        type(model).__name__ not in ARCHITECTURES
        or getattr(cfg, "attention_bias", False)
        or getattr(cfg, "mlp_bias", False)
        or cfg.hidden_act != "silu"
        or any(type(m).__name__ != "LlamaRMSNorm" for m in _norms(model))
    ):
        return None
    return LeanLlama(model)


def _norms(model: nn.Module) -> list[nn.Module]:
    """The norms the flat forward runs: the final one and those of its layers."""
    inner = model.model
    layers = inner.layers[: model.config.num_hidden_layers]
    return [inner.norm] + [
        n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
