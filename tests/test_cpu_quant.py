"""PyTorch's weight-only int4/int8 kernels as crowdchat's CPU quantized linears."""

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

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="torch lacks the CPU kernels")
needs_fbgemm = pytest.mark.skipif(
    not cpu_quant.fp16_gemm_available(), reason="no FBGEMM fp16 GEMM on this CPU/build"
)
# the dense copy in the compute dtype (float32 here), and float16 packed for FBGEMM
DENSE_KINDS = [False, pytest.param(True, marks=needs_fbgemm)]


def kind_above(rows: int, fp16: bool) -> DenseKind:
    return DenseKind(torch.float32, fp16, rows)


def q4_1_weights(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Weights on a Q4_1-like grid: per group, `min + d * q` with q in 0..15 (both ends
    used), the range spanning zero as trained weights do."""
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=gen) * 0.01 + 1e-4
    lo = -d * (5 + 5 * torch.rand(n, k // GROUP_SIZE, 1, generator=gen))
    return (lo + d * q).view(n, k)


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


def assert_rows(
    lin: torch.nn.Module, x: torch.Tensor, want: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """`lin(x)` as crowdchat's CPU kernels must give it: float32 [rows, N] rounded to bf16,
    within float32 summation order of `want` (near-cancelling sums differ by a few ulps of
    their terms, `w` the weights), then one bf16 ulp; each row bitwise the same alone or in
    any batch. Returns it."""
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], want.shape[1])
    assert torch.equal(got, got.bfloat16().float())  # rounded as the kernels round
    atol = 2**-20 * float((x.abs() @ w.abs().t()).max())
    torch.testing.assert_close(got, want, rtol=2**-7, atol=atol)
    assert torch.equal(got, torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])]))
    return got


@pytest.mark.parametrize("seed", range(4))
def test_crowdchat_int4_kernel_computes_what_torchs_does(seed: int) -> None:
    """engine/kernels/csrc/q4_linear.cpp against PyTorch's int4 kernel on the same quantized
    weights: within one bf16 ulp of each other (their sums run in different orders), at every row
    count (it takes rows 4 or 8 at a time, in chunks of 64); each row's output is bitwise the
    same alone or in any batch."""
    assert cpu_kernels.load(), "make builds them: python engine/kernels/cpu_kernels.py"
    gen = torch.Generator().manual_seed(seed)
    n, k = [(96, 64), (208, 576), (576, 1536), (48, 32)][seed]
    w = q4_1_weights(gen, n, k) * (1 + 10 * seed)
    torchs, ours = Int4Linear(w, None), Int4Linear(w, None, own=True)
    assert ours.own and not torchs.own
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, 33, 70):
        x = torch.randn(rows, k, generator=gen) * (0.1 + seed)
        assert_rows(ours, x, torchs(x), w)


@pytest.mark.parametrize("seed", range(3))
def test_crowdchat_int8_kernel_computes_what_torchs_does(seed: int) -> None:
    """The output projection's int8 kernel on AVX512-BF16 CPUs (csrc/q4_linear.cpp `int8_dot`)
    against PyTorch's `_weight_int8pack_mm` on the same int8 weights and scales: within float32
    summation order, then one bf16 ulp; each row's output the same alone or in any batch."""
    if not cpu_kernels.q4_dot_layout():
        pytest.skip("this CPU has no AVX512-BF16 (or the kernels are not built)")
    gen = torch.Generator().manual_seed(seed)
    n, k = [(48, 32), (208, 576), (1024, 96)][seed]
    w = torch.randn(n, k, generator=gen) * (0.02 + seed)
    torchs, ours = Int8Linear(w, None), Int8Linear(w, None, own=True)
    assert ours.own and not torchs.own and not Int8Linear(w[:40], None, own=True).own
    for rows in (1, 3, 8, 9, 33, 70):
        x = torch.randn(rows, k, generator=gen) * (0.1 + seed)
        assert_rows(ours, x, torchs(x), w)
    int8 = torch.ops.crowdchat.int8_dot
    with pytest.raises(RuntimeError, match="columns"):
        int8(torch.randn(2, k + 32), ours.qweight, ours.scales)
    with pytest.raises(RuntimeError, match="scales"):
        int8(torch.randn(2, k), ours.qweight, ours.scales[:16])
    with pytest.raises(RuntimeError, match="float32"):
        int8(torch.randn(2, k).bfloat16(), ours.qweight, ours.scales)
    assert int8(torch.randn(0, k), ours.qweight, ours.scales).shape == (0, n)


def q8_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per group of 32 to int8 as the int8-activation kernels round it
    (scale max|x| / 127, to nearest even): the values [M, K/32, 32] and scales [M, K/32, 1],
    float64."""
    xg = x.view(x.shape[0], -1, GROUP_SIZE)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv).clamp(-127, 127)  # float32 products, as the kernel rounds them
    return q.double(), (amax / 127).double()


def q8_reference(x: torch.Tensor, lin: Int4Linear) -> torch.Tensor:
    """What the int8-activation kernel computes, in float64 from its own inputs: x rounded per
    group of 32 to int8 (`q8_inputs`), times the 4-bit weights."""
    g = GROUP_SIZE
    q, d = q8_inputs(x)
    blocks, groups = lin.packed.shape[:2]
    so = lin.scales_zeros.view(blocks, groups, 2, 16).permute(2, 0, 3, 1).double()
    scale, offset = so[0].reshape(-1, groups), so[1].reshape(-1, groups)  # [N, K/32]
    # the nibbles back from pack_for_dot's layout: per 4 values of K, byte i of column i // 2
    b = lin.packed.view(blocks, groups, 8, 16, 2).long()  # block, group, t, column, i % 2
    qw = torch.stack([b & 15, b >> 4], 4)  # ..., half, i % 2: K = 4t + 2 half + i % 2
    qw = qw.permute(0, 3, 1, 2, 4, 5).reshape(blocks * 16, groups, g).double()
    dots = torch.einsum("mgk,ngk->mng", q, qw)
    sums = q.sum(-1)  # [M, K/32]
    return (d.squeeze(-1)[:, None] * (scale * dots + offset * sums[:, None])).sum(-1)


@pytest.mark.parametrize("seed", range(4))
def test_int8_activation_kernel_computes_llama_cpps_model(seed: int) -> None:
    """`--cpu-activations int8` (csrc/q4_linear.cpp `q4_dot_q8`): x rounded to int8 per group
    of 32 as llama.cpp rounds it, the integer sums exact; the output within float32 summation
    order of that model, then one bf16 ulp; within ~1% of the bfloat16-activation kernel;
    each row's output bitwise the same alone or in any batch; an all-zero group stays 0."""
    if not cpu_kernels.q8_activations():
        pytest.skip("this CPU has no AVX512-VNNI with AVX512-BF16 (or the kernels are not built)")
    gen = torch.Generator().manual_seed(seed)
    n, k = [(96, 64), (208, 576), (576, 1536), (48, 32)][seed]
    w = q4_1_weights(gen, n, k) * (1 + 10 * seed)
    bf16, ours = Int4Linear(w, None, own=True), Int4Linear(w, None, own=True, q8=True)
    assert ours.q8 and not bf16.q8
    for rows in (1, 2, 3, 5, 8, 9, 16, 33, 70):
        x = torch.randn(rows, k, generator=gen) * (0.1 + seed)
        x[0, :GROUP_SIZE] = 0  # a group of zeros: scale 0, no NaN
        got = assert_rows(ours, x, q8_reference(x, ours).float(), w)
        near = bf16(x)
        assert float((got - near).norm()) <= 0.02 * float(near.norm())


def test_int8_activation_output_projection() -> None:
    """The output projection's int8 weights with int8 x (`int8_dot` on uint8 weights + 128):
    per group of 32 the integer sums exact (the +128 taken off with the group's sum of x), so
    within float32 summation order of x rounded as the 4-bit kernel rounds it, then one bf16
    ulp; within ~1% of the bf16-x kernel; each row the same alone or in any batch."""
    if not cpu_kernels.q8_activations():
        pytest.skip("this CPU has no AVX512-VNNI with AVX512-BF16 (or the kernels are not built)")
    gen = torch.Generator().manual_seed(0)
    for n, k in [(48, 32), (208, 576), (1024, 96)]:
        w = torch.randn(n, k, generator=gen) * 0.05
        bf16, ours = Int8Linear(w, None, own=True), Int8Linear(w, None, own=True, q8=True)
        assert ours.q8 and ours.qweight.dtype == torch.uint8 and not bf16.q8
        q = (ours.qweight.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k)).long()
        wq = (q - 128).double() * ours.scales.double()[:, None]  # the weights it computes with
        for rows in (1, 3, 8, 9, 33, 70):
            x = torch.randn(rows, k, generator=gen)
            q, d = q8_inputs(x)
            got = assert_rows(ours, x, ((q * d).view(rows, k) @ wq.t()).float(), w)
            near = bf16(x)
            assert float((got - near).norm()) <= 0.02 * float(near.norm())
    int8 = torch.ops.crowdchat.int8_dot
    with pytest.raises(RuntimeError, match="columns"):
        int8(torch.randn(2, k + 32), ours.qweight, ours.scales)
    with pytest.raises(RuntimeError, match="scales"):
        int8(torch.randn(2, k), ours.qweight, ours.scales[:16])
    with pytest.raises(RuntimeError, match="packed"):
        int8(torch.randn(2, k), ours.qweight.view(n // 16, k // 2, 32), ours.scales)


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


def test_crowdchat_int4_kernel_rejects_what_it_cannot_compute() -> None:
    assert cpu_kernels.load(), "make builds them: python engine/kernels/cpu_kernels.py"
    ours = Int4Linear(torch.randn(8, 64), None, own=True)
    q4 = torch.ops.crowdchat.q4_linear
    with pytest.raises(RuntimeError, match="columns"):
        q4(torch.randn(2, 32), ours.packed, ours.scales_zeros)
    with pytest.raises(RuntimeError, match="float32"):
        q4(torch.randn(2, 64).bfloat16(), ours.packed, ours.scales_zeros)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), ours.packed, ours.scales_zeros[:4])
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), ours.packed, ours.scales_zeros.float())
    assert q4(torch.randn(0, 64), ours.packed, ours.scales_zeros).shape == (0, 8)
    # the AVX512-BF16 layout (columns in blocks of 16) where this CPU has it
    dot = Int4Linear(torch.randn(32, 64), None, own=True)
    if not cpu_kernels.q4_dot_layout():
        assert dot.packed.shape == (32, 2, 16)
        return
    assert dot.packed.shape == (2, 2, 256) and dot.scales_zeros.shape == (2, 2, 32)
    with pytest.raises(RuntimeError, match="columns"):
        q4(torch.randn(2, 32), dot.packed, dot.scales_zeros)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), dot.packed, dot.scales_zeros[:1])
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), dot.packed, dot.scales_zeros.half())
    if cpu_kernels.q8_activations():  # float32 scales and offsets: the int8-activation kernel
        q8 = Int4Linear(torch.randn(32, 64), None, own=True, q8=True)
        assert q8.q8 and q8.scales_zeros.dtype == torch.float32
        with pytest.raises(RuntimeError, match="columns"):
            q4(torch.randn(2, 32), q8.packed, q8.scales_zeros)
        with pytest.raises(RuntimeError, match="scales_offsets"):
            q4(torch.randn(2, 64), q8.packed, q8.scales_zeros[:1])
        assert q4(torch.randn(0, 64), q8.packed, q8.scales_zeros).shape == (0, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        q4(torch.randn(2, 64), dot.packed.transpose(0, 1), dot.scales_zeros)
    assert q4(torch.randn(0, 64), dot.packed, dot.scales_zeros).shape == (0, 32)


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
    # on AVX512-BF16 CPUs crowdchat's kernels run every row count: no dense copies beside them,
    # and the output projection int8 on the same kind of kernel
    dot = own and cpu_kernels.q4_dot_layout()
    layers = nf4_model.model.model.layers
    assert all((m.dense is None) == dot for m in layers.modules() if isinstance(m, Int4Linear))
    if dot:
        assert isinstance(head, Int8Linear) and head.own and head.dense is None
        # int8 activations where the kernel has them (--cpu-activations auto)
        q8 = cpu_kernels.q8_activations()
        assert all(m.q8 == q8 for m in layers.modules() if isinstance(m, Int4Linear))
        assert nf4_model.kernel == "crowdchat-dot-int4g32" + ("-q8" if q8 else "")
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
