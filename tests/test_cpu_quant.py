"""PyTorch's weight-only int4/int8 kernels as crowdchat's CPU quantized linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_quant
from engine.cpu_quant import GROUP_SIZE, Int4Linear, Int8Linear
from engine.loader import LoadedModel

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="torch lacks the CPU kernels")


def q4_1_weights(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Weights on a Q4_1-like grid: per group, `min + d * q` with q in 0..15 (both ends
    used), the range spanning zero as trained weights do."""
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=gen) * 0.01 + 1e-4
    lo = -d * (5 + 5 * torch.rand(n, k // GROUP_SIZE, 1, generator=gen))
    return (lo + d * q).view(n, k)


@pytest.mark.parametrize("seed", range(3))
def test_int4_repacks_a_4_bit_grid_and_both_paths_compute_the_same_weights(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, k = 96, 192
    w = q4_1_weights(gen, n, k)
    lin = Int4Linear(w, dense_rows=4)
    # the same grid point for every weight: only the kernel's bfloat16 scale and zero round
    # (GGUF keeps them in float16), by far less than a step
    step = w.view(n, -1, GROUP_SIZE).aminmax(dim=-1)
    step = ((step.max - step.min) / 15).repeat_interleave(GROUP_SIZE, dim=1)
    assert ((lin.dense - w).abs() <= 0.1 * step).all()
    for rows in (1, 3, 9, 40):  # packed kernel up to 4 rows, the dense copy above
        x = torch.randn(rows, k, generator=gen)
        ref = F.linear(x.bfloat16().float(), w)
        torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(3))
def test_int8_per_channel_is_within_a_step_of_the_weights(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=gen) * 0.02
    lin = Int8Linear(w, dense_rows=2)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((lin.dense - w).abs() <= 0.5 * step * (1 + 2**-7)).all()  # bf16 step >= fp32
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(lin(x[:1]), F.linear(x[:1], lin.dense), rtol=2e-2, atol=2e-3)
    # 5 rows > 2: the dense copy, rounded as the kernel rounds (bf16 in and out)
    want = F.linear(x.bfloat16().float(), lin.dense).bfloat16().float()
    torch.testing.assert_close(lin(x), want)


def test_packed_only_keeps_no_dense_copy() -> None:
    lin = Int4Linear(torch.randn(32, 64), dense_rows=None)
    assert lin.dense is None
    assert lin(torch.randn(50, 64)).shape == (50, 32)  # every batch on the packed kernel
    assert lin(torch.randn(2, 7, 64)).shape == (2, 7, 32)


def test_the_default_cpu_model_runs_on_torch_int4_kernels(nf4_model: LoadedModel) -> None:
    """`--quant nf4` on CPU: every decoder linear packed in int4, the output projection int8,
    and the kernel named in the KV fingerprint (a bitsandbytes snapshot is not reused)."""
    if nf4_model.device.type != "cpu":
        pytest.skip("CUDA keeps bitsandbytes")
    kinds = {type(m).__name__ for m in nf4_model.model.modules()}
    assert "Int4Linear" in kinds and "Linear4bit" not in kinds
    assert isinstance(nf4_model.model.get_output_embeddings(), Int8Linear)
    assert not any(type(m) is torch.nn.Linear for m in nf4_model.model.model.layers.modules())
    assert nf4_model.kernel == "torch-int4g32"
    assert nf4_model.fingerprint(16)["quant"] == "nf4/torch-int4g32"


def test_a_q4_1_gguf_requantizes_to_int4_without_loss(fp32_model: LoadedModel) -> None:
    """The embedded GGUF is Q4_1 (blocks of 32, a scale and a minimum): groups of 32 land on
    its blocks, so the int4 weights are the GGUF's own values up to the bf16 rounding of the
    scale and zero. Groups of 64 (tried) straddled two blocks, erred ~10x more and broke the
    model's replies ("1.1.1.1..." for "count from 1 to 20")."""
    dense = fp32_model.model.model.layers[0].self_attn.q_proj.weight
    packed = Int4Linear(dense, dense_rows=1)
    assert packed.group_size == 32
    err = (packed.dense.float() - dense).norm() / dense.norm()
    assert err < 0.01, err


@pytest.mark.parametrize("make", [Int4Linear, Int8Linear])
def test_fused_projections_compute_exactly_what_separate_ones_do(make: type) -> None:
    """q/k/v (and gate/up) quantized as one matrix give bitwise the separate layers' outputs,
    on the packed kernel (<= 16 rows) and the dense copy (more), in any call order."""
    from engine.fused_proj import FusedProjection, ProjectionPart, fuse_projections

    gen = torch.Generator().manual_seed(5)
    parent = torch.nn.Module()
    sizes = {"q_proj": 576, "k_proj": 192, "v_proj": 192}  # the embedded model's
    for name, n in sizes.items():
        lin = torch.nn.Linear(576, n, bias=False)
        lin.weight.data = (torch.randn(n, 576, generator=gen) * 0.05).bfloat16()
        setattr(parent, name, lin)
    separate = {n: make(getattr(parent, n).weight, 16) for n in sizes}
    fits = lambda m: True  # noqa: E731
    assert fuse_projections(parent, lambda w: make(w, 16), cpu_quant.split_forward, fits) == 1
    assert isinstance(parent.q_proj, ProjectionPart)
    assert sum(isinstance(m, FusedProjection) for m in parent.modules()) == 1
    # 237 rows: one dense matmul of the fused width rounded 1 ulp off the separate ones
    for rows in (1, 16, 17, 237, 500):
        x = torch.randn(1, rows, 576, generator=gen).bfloat16()
        for order in (["q_proj", "k_proj", "v_proj"], ["v_proj", "q_proj", "k_proj"]):
            for n in order:
                assert torch.equal(getattr(parent, n)(x), separate[n](x)), (rows, n)
    for n in sizes:  # in transformers' order, the last part lets the step's tensors go
        getattr(parent, n)(x)
    assert parent.q_k_v._input is None


def test_the_default_model_makes_four_kernel_calls_per_layer(nf4_model: LoadedModel) -> None:
    """q/k/v fused, o, gate/up fused, down: 120 weight kernels a token instead of 210."""
    if nf4_model.device.type != "cpu":
        pytest.skip("CUDA keeps bitsandbytes")
    layers = nf4_model.model.model.layers
    kernels = [m for m in layers.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(kernels) == 4 * len(layers)
