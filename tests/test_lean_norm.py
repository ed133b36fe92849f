"""The one-op RMSNorm computes bitwise what transformers' Llama RMSNorm computes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.kernels import cpu_kernels
from engine.model.lean_norm import fuse_norms
from engine.model.loader import LoadedModel


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_transformers_bitwise(
    dtype: torch.dtype, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With crowdchat's CPU kernels (float32: `crowdchat::rms_norm`) and without them
    (`torch.rms_norm`)."""
    if kernel and not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels cannot be built here")
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)
    gen = torch.Generator().manual_seed(3)
    for width in (576, 100, 960, 2048):  # the sum's order of addition depends on the width
        ref = LlamaRMSNorm(width, eps=1e-5)
        ref.weight.data = (torch.randn(width, generator=gen) * 0.2 + 1).to(dtype)
        lean = LlamaRMSNorm(width, eps=1e-5)
        lean.weight.data = ref.weight.data.clone()
        assert fuse_norms(lean) == 1
        for rows in (1, 3, 7, 32, 500):
            for scale in (1e-3, 1.0, 40.0, 1e4):
                x = (torch.randn(1, rows, width, generator=gen) * scale).to(dtype)
                with torch.inference_mode():
                    assert torch.equal(lean(x), ref(x)), (width, rows, scale)


def test_the_engine_model_runs_the_fused_norms(nf4_model: LoadedModel, tmp_path) -> None:
    from tests.conftest import make_engine

    engine = make_engine(nf4_model, tmp_path)
    try:
        norm = nf4_model.model.model.layers[0].input_layernorm
        assert norm.forward.__func__.__module__ == "engine.model.lean_norm"
    finally:
        engine.shutdown()
