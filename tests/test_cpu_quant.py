"""PyTorch's weight-only int4/int8 kernels as crowdchat's CPU quantized linears: the weights
they compute with, the dense copies beside them, fused projections, and the default model on
them. crowdchat's own C++ kernels against PyTorch's are tests/test_cpu_quant_kernels.py's."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from bench.throughput import TEXT
from engine.kernels import cpu_kernels
from engine.model import cpu_quant
from engine.model.cpu_quant import GROUP_SIZE, DenseKind, Fp16Linear, Int4Linear, Int8Linear
from engine.model.loader import LoadedModel
from tests.quant_weights import q4_1_weights

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="torch lacks the CPU kernels")
needs_fbgemm = pytest.mark.skipif(
    not cpu_quant.fp16_gemm_available(), reason="no FBGEMM fp16 GEMM on this CPU/build"
)
# the dense copy in the compute dtype (float32 here), and float16 packed for FBGEMM
DENSE_KINDS = [False, pytest.param(True, marks=needs_fbgemm)]


def kind_above(rows: int, fp16: bool) -> DenseKind:
    return DenseKind(torch.float32, fp16, rows)


@pytest.mark.parametrize("fp16", DENSE_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_int4_repacks_a_4_bit_grid_and_both_paths_compute_the_same_weights(
    seed: int, fp16: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, k = 96, 192
    w = q4_1_weights(gen, n, k)
    lin = Int4Linear(w, kind_above(4, fp16))
    # the same grid point for every weight: only the kernel's bfloat16 scale and zero round
    # (GGUF keeps them in float16), by far less than a step
    step = w.view(n, -1, GROUP_SIZE).aminmax(dim=-1)
    step = ((step.max - step.min) / 15).repeat_interleave(GROUP_SIZE, dim=1)
    assert ((lin.dense.values() - w).abs() <= 0.1 * step).all()
    for rows in (1, 3, 9, 40):  # packed kernel up to 4 rows, the dense copy above
        x = torch.randn(rows, k, generator=gen)
        ref = F.linear(x.bfloat16().float(), w)
        torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fp16", DENSE_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_int8_per_channel_is_within_a_step_of_the_weights(seed: int, fp16: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=gen) * 0.02
    lin = Int8Linear(w, kind_above(2, fp16))
    step = w.abs().amax(1, keepdim=True) / 127
    values = lin.dense.values()
    # bf16 scale >= fp32's; float16 rounds each value within 2**-11 of itself
    assert ((values - w).abs() <= 0.5 * step * (1 + 2**-7) + w.abs() * 2**-11).all()
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(lin(x[:1]), F.linear(x[:1], values), rtol=2e-2, atol=2e-3)
    # 5 rows > 2: the dense copy, rounded as the kernel rounds (bf16 in and out)
    want = F.linear(x.bfloat16().float(), values).bfloat16().float()
    torch.testing.assert_close(lin(x), want)


@needs_fbgemm
def test_fp16_copy_computes_each_row_alone_as_in_any_batch() -> None:
    """FBGEMM's fp16 GEMM: a sequence's outputs depend on the other rows of its step only by
    float32 rounding (FBGEMM blocks rows differently by count: then at most one bf16 ulp after
    the kernels' rounding), and the output projection in float16 stays within float16's
    rounding of the float32 weights (seeded shapes and row counts)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(200, 96, generator=gen) * 0.05
    head = Fp16Linear(w)
    assert ((head.dense.values() - w).abs() <= w.abs() * 2**-11 + 2**-24).all()
    lin = Int4Linear(q4_1_weights(gen, 64, 96), kind_above(4, True))
    for rows in torch.randint(5, 70, (6,), generator=gen).tolist():
        x = torch.randn(1, rows, 96, generator=gen)
        for m in (head, lin):
            batch = m(x)
            assert batch.shape == (1, rows, m.out_features)
            solo = torch.cat([m(x[:, i : i + 1]) for i in range(rows)], dim=1)
            if m is head:  # every row count runs float16
                torch.testing.assert_close(batch, solo, rtol=2**-7, atol=0)
            want = F.linear(x.bfloat16().float(), m.dense.values()).bfloat16().float()
            torch.testing.assert_close(batch, want, rtol=2**-7, atol=1e-5)


def test_the_default_cpu_model_predicts_what_float32_does(
    nf4_model: LoadedModel, fp32_model: LoadedModel
) -> None:
    """The default model (on AVX512-VNNI CPUs with int8 activations) against the same weights
    in float32 (a Q4_1 GGUF requantizes without loss): over ~300 tokens of text, teacher-forced,
    the same next token almost everywhere and a small KL divergence (measured on the Zen 5
    EPYC: 98.5% and 0.0022 with int8 activations, 99.3% and 0.0009 with bf16 ones)."""
    if nf4_model.device.type != "cpu":
        pytest.skip("CUDA keeps bitsandbytes")
    ids = fp32_model.tokenizer.encode(TEXT * 3, return_tensors="pt")[:, :300]
    models = (fp32_model.model, nf4_model.model)
    for m in models:  # outside the engine: transformers' own attention
        m.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            want, got = (m(ids).logits[0].double().log_softmax(-1) for m in models)
    finally:
        for m in models:
            m.set_attn_implementation("crowdchat_paged")
    agree = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    assert agree >= 0.96 and kl <= 0.006, (agree, kl)


def test_packed_only_keeps_no_dense_copy() -> None:
    lin = Int4Linear(torch.randn(32, 64), None)
    assert lin.dense is None
    assert lin(torch.randn(50, 64)).shape == (50, 32)  # every batch on the packed kernel
    assert lin(torch.randn(2, 7, 64)).shape == (2, 7, 32)


def test_the_default_cpu_model_runs_on_torch_int4_kernels(nf4_model: LoadedModel) -> None:
    """`--quant nf4` on CPU: every decoder linear packed in int4, the output projection int8
    (float16 where the dense copies are FBGEMM's), and the kernels named in the KV fingerprint
    (a bitsandbytes snapshot, or one computed on other dense copies, is not reused)."""
    if nf4_model.device.type != "cpu":
        pytest.skip("CUDA keeps bitsandbytes")
    kinds = {type(m).__name__ for m in nf4_model.model.modules()}
    assert "Int4Linear" in kinds and "Linear4bit" not in kinds
    assert not any(type(m) is torch.nn.Linear for m in nf4_model.model.model.layers.modules())
    head = nf4_model.model.get_output_embeddings()
    # crowdchat's own 4-bit kernel where compute is float32 (engine.kernels.cpu_kernels,
    # built by make)
    own = nf4_model.dtype == torch.float32
    assert all(m.own == own for m in nf4_model.model.modules() if isinstance(m, Int4Linear))
    int4 = "crowdchat-int4g32" if own else "torch-int4g32"
    # on AVX512-BF16 CPUs, and wherever the int8-activation kernels run (AVX2 and
    # AVX512-VNNI; --cpu-activations auto), crowdchat's kernels run every row count: no dense
    # copies beside them, and the output projection int8 on the same kind of kernel
    q8 = own and cpu_kernels.q8_activations()
    dot = own and cpu_kernels.q4_dot_layout()
    layers = nf4_model.model.model.layers
    packed = [m for m in layers.modules() if isinstance(m, Int4Linear)]
    assert all((m.dense is None) == (dot or q8) for m in packed)
    assert all(m.q8 == q8 for m in packed)
    if dot or q8:
        assert isinstance(head, Int8Linear) and head.own and head.dense is None and head.q8 == q8
        layout = "-dot" if dot else ""
        # no step on the bf16 GEMM unless asked (engine.model.bf16_gemm, --cpu-bf16-above)
        assert all(m.bf16_rows == 0 for m in packed)
        assert nf4_model.kernel == f"crowdchat{layout}-int4g32" + ("-q8" if q8 else "")
    elif cpu_quant.dense_kind(nf4_model.dtype, None).fp16:
        assert isinstance(head, Fp16Linear)
        assert nf4_model.kernel == int4 + "+fp16"
        # the packed copies count as the model's memory (the admin page, the KV budget)
        assert nf4_model.model_bytes > nf4_model.model.get_memory_footprint() + 200 * 2**20
    else:
        assert isinstance(head, Int8Linear)
        assert nf4_model.kernel == int4
    assert nf4_model.fingerprint(16)["quant"] == f"nf4/{nf4_model.kernel}"


def test_a_q4_1_gguf_requantizes_to_int4_without_loss(fp32_model: LoadedModel) -> None:
    """The embedded GGUF is Q4_1 (blocks of 32, a scale and a minimum): groups of 32 land on
    its blocks, so the int4 weights are the GGUF's own values up to the bf16 rounding of the
    scale and zero. Groups of 64 (tried) straddled two blocks, erred ~10x more and broke the
    model's replies ("1.1.1.1..." for "count from 1 to 20")."""
    dense = fp32_model.model.model.layers[0].self_attn.q_proj.weight
    packed = Int4Linear(dense, kind_above(1, fp16=False))
    assert packed.group_size == 32
    err = (packed.dense.values() - dense).norm() / dense.norm()
    assert err < 0.01, err


@pytest.mark.parametrize("fp16", DENSE_KINDS)
@pytest.mark.parametrize(
    "make", [Int4Linear, Int8Linear, partial(Int4Linear, own=True)], ids=["int4", "int8", "own"]
)
def test_fused_projections_compute_exactly_what_separate_ones_do(make: type, fp16: bool) -> None:
    """q/k/v (and gate/up) quantized as one matrix give bitwise the separate layers' outputs,
    on the packed kernel (<= 16 rows; PyTorch's or crowdchat's) and the dense copy (more, bf16
    or FBGEMM's float16), in any call order."""
    from engine.model.fused_proj import FusedProjection, ProjectionPart, fuse_projections

    if isinstance(make, partial):
        if not fp16:
            pytest.skip("crowdchat's 4-bit kernel serves float32 compute")
        assert cpu_kernels.load(), "make builds them: python engine/kernels/cpu_kernels.py"
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float32 if fp16 else torch.bfloat16
    parent = torch.nn.Module()
    sizes = {"q_proj": 576, "k_proj": 192, "v_proj": 192}  # the embedded model's
    for name, n in sizes.items():
        lin = torch.nn.Linear(576, n, bias=False)
        lin.weight.data = (torch.randn(n, 576, generator=gen) * 0.05).to(dtype)
        setattr(parent, name, lin)
    kind = DenseKind(dtype, fp16, 16)
    separate = {n: make(getattr(parent, n).weight, kind) for n in sizes}
    fits = lambda m: True  # noqa: E731
    assert fuse_projections(parent, lambda w: make(w, kind), cpu_quant.split_forward, fits) == 1
    assert isinstance(parent.q_proj, ProjectionPart)
    assert sum(isinstance(m, FusedProjection) for m in parent.modules()) == 1
    # 237 rows: one dense matmul of the fused width rounded 1 ulp off the separate ones
    for rows in (1, 16, 17, 237, 500):
        x = torch.randn(1, rows, 576, generator=gen).to(dtype)
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
