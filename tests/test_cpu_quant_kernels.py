"""crowdchat's own 4-bit and int8 CPU kernels (engine/kernels/csrc/q4_linear.cpp) against
PyTorch's on the same quantized weights, and llama.cpp's int8-activation model of them: within
float32 summation order, then one bf16 ulp; each row the same alone or in any batch; what they
cannot compute refused."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.model import cpu_quant
from engine.model.cpu_quant import GROUP_SIZE, Int4Linear, Int8Linear
from tests.quant_weights import q4_1_weights

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="torch lacks the CPU kernels")


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


def int8_dot_refuses_other_widths_and_scales(lin: Int8Linear, k: int) -> None:
    """`int8_dot` over `lin`'s weights (K = `k`) refuses x of another width and too few scales."""
    int8 = torch.ops.crowdchat.int8_dot
    with pytest.raises(RuntimeError, match="columns"):
        int8(torch.randn(2, k + 32), lin.qweight, lin.scales)
    with pytest.raises(RuntimeError, match="scales"):
        int8(torch.randn(2, k), lin.qweight, lin.scales[:16])


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
    int8_dot_refuses_other_widths_and_scales(ours, k)
    int8 = torch.ops.crowdchat.int8_dot
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


def q4_values(lin: Int4Linear) -> tuple[torch.Tensor, ...]:
    """The 4-bit weights an int8-activation kernel computes with, from its own layout (the
    AVX512 one, `pack_for_dot`, or the AVX2 one, `pack_for_avx2`): nibbles [N, K/32, 32], scales
    and offsets `zero - 8 scale` [N, K/32], float64."""
    g = GROUP_SIZE
    if lin.packed.shape[-1] == 128:  # AVX2: per 8 values of K, byte 4c + j: 8p + j low, + 4 high
        blocks, groups = lin.packed.shape[:2]
        b = lin.packed.view(blocks, groups, 4, 8, 4).long()  # block, group, p, column, j
        qw = torch.stack([b & 15, b >> 4], 3)  # block, group, p, half, column, j
        qw = qw.permute(0, 4, 1, 2, 3, 5).reshape(blocks * 8, groups, g).double()
        sz = lin.scales_zeros.view(blocks, groups, 2, 8).permute(2, 0, 3, 1).double()
        scale, zero = sz[0].reshape(-1, groups), sz[1].reshape(-1, groups)
        return qw, scale, zero - 8 * scale
    blocks, groups = lin.packed.shape[:2]
    so = lin.scales_zeros.view(blocks, groups, 2, 16).permute(2, 0, 3, 1).double()
    scale, offset = so[0].reshape(-1, groups), so[1].reshape(-1, groups)  # [N, K/32]
    # the nibbles back from pack_for_dot's q8 layout: per group 4 x 64 bytes, byte 4c + j
    # of the p-th column c's q[8p + j] (low nibble) and q[8p + 4 + j] (high)
    b = lin.packed.view(blocks, groups, 4, 16, 4).long()  # block, group, p, column, j
    qw = torch.stack([b & 15, b >> 4], 3)  # block, group, p, half, column, j
    qw = qw.permute(0, 4, 1, 2, 3, 5).reshape(blocks * 16, groups, g).double()
    return qw, scale, offset


def q8_reference(x: torch.Tensor, lin: Int4Linear) -> torch.Tensor:
    """What the int8-activation kernel computes, in float64 from its own inputs: x rounded per
    group of 32 to int8 (`q8_inputs`), times the 4-bit weights."""
    q, d = q8_inputs(x)
    qw, scale, offset = q4_values(lin)
    dots = torch.einsum("mgk,ngk->mng", q, qw)
    sums = q.sum(-1)  # [M, K/32]
    return (d.squeeze(-1)[:, None] * (scale * dots + offset * sums[:, None])).sum(-1)


def int8_values(lin: Int8Linear) -> torch.Tensor:
    """The int8 weights [N, K] the int8-activation kernel computes with, from its layout."""
    n, k = lin.out_features, lin.in_features
    if lin.qweight.dtype == torch.int8:  # AVX2: [N/8, K/4, 32], bytes 4c + j: K = 4t + j
        return lin.qweight.view(n // 8, k // 4, 8, 4).permute(0, 2, 1, 3).reshape(n, k).long()
    q = lin.qweight.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k).long()
    return q - 128  # AVX512-VNNI: uint8 q + 128 [N/16, K/4, 64]


@pytest.mark.parametrize("seed", range(4))
def test_int8_activation_kernel_computes_llama_cpps_model(seed: int) -> None:
    """`--cpu-activations int8` (csrc/q4_linear.cpp `q4_dot_q8` on AVX512-VNNI, csrc/q8_avx2.cpp
    on AVX2): x rounded to int8 per group of 32 as llama.cpp rounds it, the integer sums exact;
    the output within float32 summation order of that model, then one bf16 ulp; within ~1% of
    the bfloat16-activation kernel; each row's output bitwise the same alone or in any batch;
    an all-zero group stays 0."""
    if not cpu_kernels.q8_activations():
        pytest.skip("this build has no int8-activation kernel (AVX2 or AVX512-VNNI)")
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


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_activation_kernel_at_its_integer_bounds(sign: float) -> None:
    """The largest integer sums the int8-activation kernels meet: every nibble 15 (but one 0 a
    group, the group's minimum) against x at +-127 in every place, so each group's products
    all share a sign (the AVX2 kernel sums a group's pairs of products in int16 lanes before
    widening them: 30,480 of 32,767 here): the output is still llama.cpp's model of it,
    as exact as anywhere else, rows alone or batched alike."""
    if not cpu_kernels.q8_activations():
        pytest.skip("this build has no int8-activation kernel (AVX2 or AVX512-VNNI)")
    n, k = 64, 576
    w = torch.full((n, k), 0.5)
    w.view(n, -1, GROUP_SIZE)[:, :, 7] = -0.25  # the group's minimum: nibble 0, the rest 15
    lin = Int4Linear(w, None, own=True, q8=True)
    qw, _, _ = q4_values(lin)
    assert int((qw == 15).sum()) == n * k - n * k // GROUP_SIZE
    x = torch.full((5, k), 3.0 * sign)
    x[1] *= torch.linspace(0.5, 1.0, k)  # values below the group's maximum too
    x[2, :GROUP_SIZE] = 0  # an all-zero group beside full ones
    got = assert_rows(lin, x, q8_reference(x, lin).float(), w)
    assert bool((got * sign > 0).all())


def test_int8_activation_output_projection() -> None:
    """The output projection's int8 weights with int8 x (`int8_dot`: on AVX512-VNNI uint8
    weights + 128, the +128 taken off with the group's sum of x; on AVX2 |w| times x with w's
    sign): per group of 32 the integer sums exact, so
    within float32 summation order of x rounded as the 4-bit kernel rounds it, then one bf16
    ulp; within ~1% of the bf16-x kernel; each row the same alone or in any batch."""
    if not cpu_kernels.q8_activations():
        pytest.skip("this build has no int8-activation kernel (AVX2 or AVX512-VNNI)")
    gen = torch.Generator().manual_seed(0)
    for n, k in [(48, 32), (208, 576), (1024, 96)]:
        w = torch.randn(n, k, generator=gen) * 0.05
        bf16, ours = Int8Linear(w, None, own=True), Int8Linear(w, None, own=True, q8=True)
        assert ours.q8 and not bf16.q8
        wq = int8_values(ours).double() * ours.scales.double()[:, None]  # what it computes with
        for rows in (1, 3, 8, 9, 33, 70):
            x = torch.randn(rows, k, generator=gen)
            q, d = q8_inputs(x)
            got = assert_rows(ours, x, ((q * d).view(rows, k) @ wq.t()).float(), w)
            near = bf16(x)
            assert float((got - near).norm()) <= 0.02 * float(near.norm())
    int8_dot_refuses_other_widths_and_scales(ours, k)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.crowdchat.int8_dot(torch.randn(2, k), ours.qweight.view(n, k), ours.scales)


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
        avx2_int8_activation_kernels_refuse_what_they_cannot_compute()
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


def avx2_int8_activation_kernels_refuse_what_they_cannot_compute() -> None:
    """csrc/q8_avx2.cpp's layouts (columns in blocks of 8) where this build has them: a width
    of x unlike the weights', scales of another shape or dtype, rows of 0; weights whose
    columns are not a multiple of 8 stay on the bfloat16-activation kernel."""
    if not cpu_kernels.q8_activations():
        return
    q4, int8 = torch.ops.crowdchat.q4_linear, torch.ops.crowdchat.int8_dot
    lin = Int4Linear(torch.randn(40, 64), None, own=True, q8=True)
    assert lin.q8 and lin.packed.shape == (5, 2, 128) and lin.scales_zeros.shape == (5, 2, 16)
    assert not Int4Linear(torch.randn(36, 64), None, own=True, q8=True).q8
    with pytest.raises(RuntimeError, match="columns"):
        q4(torch.randn(2, 32), lin.packed, lin.scales_zeros)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), lin.packed, lin.scales_zeros[:4])
    with pytest.raises(RuntimeError, match="scales_zeros"):
        q4(torch.randn(2, 64), lin.packed, lin.scales_zeros.float())
    with pytest.raises(RuntimeError, match="packed"):
        q4(torch.randn(2, 64), lin.packed.transpose(0, 1), lin.scales_zeros)
    assert q4(torch.randn(0, 64), lin.packed, lin.scales_zeros).shape == (0, 40)
    head = Int8Linear(torch.randn(40, 64), None, own=True, q8=True)
    assert head.q8 and head.qweight.shape == (5, 16, 32)
    assert not Int8Linear(torch.randn(36, 64), None, own=True, q8=True).own
    int8_dot_refuses_other_widths_and_scales(head, 64)
    with pytest.raises(RuntimeError, match="float32"):
        int8(torch.randn(2, 64).bfloat16(), head.qweight, head.scales)
    assert int8(torch.randn(0, 64), head.qweight, head.scales).shape == (0, 40)


def test_amx_tiles_give_the_vpdpbusd_results_bitwise() -> None:
    """On AMX (Sapphire Rapids and later Xeons) the int8-activation kernels take their integer
    sums from tiles past a few rows: the sums are exact integers, so the 4-bit linears and the
    output projection give bitwise what `vpdpbusd` gives, at any row count (tiles of 16 rows,
    a ragged last one), for K of an odd number of groups, weights of any size and zero rows."""
    if not cpu_kernels.amx_tiles():
        pytest.skip("no AMX here (or this build has no int8-activation kernel)")
    gen = torch.Generator().manual_seed(7)
    shapes = [(96, 64), (208, 576), (576, 1536), (48, 32), (32, 96)]
    ops = torch.ops.crowdchat
    try:
        for n, k in shapes:
            w = q4_1_weights(gen, n, k) * float(torch.rand(1, generator=gen) * 20)
            lin = Int4Linear(w, None, own=True, q8=True)
            head = Int8Linear(w, None, own=True, q8=True)
            for _ in range(6):
                rows = int(torch.randint(1, 80, (1,), generator=gen))
                x = torch.randn(rows, k, generator=gen) * float(torch.rand(1, generator=gen) * 9)
                x[rows // 2] = 0
                got = []
                for on in (True, False):
                    ops.set_amx(on)
                    got.append((lin(x), head(x)))
                assert torch.equal(got[0][0], got[1][0]), (n, k, rows)
                assert torch.equal(got[0][1], got[1][1]), (n, k, rows)
    finally:
        ops.set_amx(cpu_kernels.amx_wanted())
    assert cpu_kernels.amx_tiles()


def test_the_amx_switch_takes_only_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CROWDCHAT_KERNEL_AMX: unset or 1 lets the kernels use AMX, 0 holds them to `vpdpbusd`,
    anything else is an error naming the variable."""
    for value, want in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(cpu_kernels.AMX_VARIABLE, value)
        assert cpu_kernels.amx_wanted() is want
    monkeypatch.setenv(cpu_kernels.AMX_VARIABLE, "yes")
    with pytest.raises(ValueError, match="CROWDCHAT_KERNEL_AMX"):
        cpu_kernels.amx_wanted()
