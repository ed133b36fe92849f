"""The one-op RMSNorm computes bitwise what transformers' Llama RMSNorm computes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.lean_norm import fuse_norms
from engine.loader import LoadedModel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_transformers_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    ref = LlamaRMSNorm(576, eps=1e-5)
    ref.weight.data = (torch.randn(576, generator=gen) * 0.2 + 1).to(dtype)
    lean = LlamaRMSNorm(576, eps=1e-5)
    lean.weight.data = ref.weight.data.clone()
    assert fuse_norms(lean) == 1
    for rows in (1, 7, 32, 500):
        for scale in (1e-3, 1.0, 40.0):
            x = (torch.randn(1, rows, 576, generator=gen) * scale).to(dtype)
            with torch.inference_mode():
                assert torch.equal(lean(x), ref(x)), (rows, scale)


def test_the_engine_model_runs_the_fused_norms(nf4_model: LoadedModel, tmp_path) -> None:
    from tests.conftest import make_engine

    engine = make_engine(nf4_model, tmp_path)
    try:
        norm = nf4_model.model.model.layers[0].input_layernorm
        assert norm.forward.__func__.__module__ == "engine.lean_norm"
    finally:
        engine.shutdown()
