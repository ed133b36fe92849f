"""Many-row steps of the 4-bit linears on the bf16 GEMM (engine.model.bf16_gemm): the widened
weights are exactly the packed ones, the matmul agrees with the int8 kernel within the
activations' rounding, a linear switches by its row count, and the model's logits stay within
the nf4 tolerance when every step of more than one row takes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.chat_format import ChatFormatter
from engine.kernels import cpu_kernels
from engine.model import bf16_gemm
from engine.model.cpu_quant import Int4Linear
from engine.model.loader import LoadedModel
from engine.sequence import Sequence
from tests.conftest import make_engine
from tests.step_logits import first_step_logits
from tests.test_batching import GREEDY, assert_same_top_within_tolerance, prompts

pytestmark = pytest.mark.skipif(
    not (
        cpu_kernels.load()
        and cpu_kernels.q4_dot_layout()
        and cpu_kernels.q8_activations()
        and hasattr(torch.ops.crowdchat, "q4_dequant_bf16_")
    ),
    reason="the int8-activation kernel's AVX-512 layout (AVX512-BF16 and VNNI) is not built here",
)


def linear(n: int, k: int, seed: int) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    return Int4Linear(torch.randn(n, k, generator=gen) * 0.05, None, own=True, q8=True)


def unpacked(m: Int4Linear) -> torch.Tensor:
    """The weights [N, K] read back from the documented layout (cpu_quant.pack_for_dot, q8),
    `q * scale + offset` computed exactly and rounded once to float32, then to bfloat16."""
    packed, so = m.packed, m.scales_zeros
    blocks, groups = packed.shape[:2]
    b = packed.view(blocks, groups, 4, 16, 4).long()  # block, group, p, column, j
    q = torch.stack([b & 15, b >> 4], 3)  # block, group, p, half, column, j: K = 8p + 4h + j
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(blocks * 16, groups, 32).double()
    s = so[..., :16].permute(0, 2, 1).reshape(blocks * 16, groups, 1).double()
    o = so[..., 16:].permute(0, 2, 1).reshape(blocks * 16, groups, 1).double()
    return (q * s + o).view(blocks * 16, groups * 32).float().to(torch.bfloat16)


@pytest.mark.parametrize("n,k,first,columns", [(64, 96, 0, 64), (96, 64, 2, 48), (48, 128, 1, 16)])
def test_widened_weights_are_the_packed_ones_bitwise(
    n: int, k: int, first: int, columns: int
) -> None:
    m = linear(n, k, n + k)
    assert m.widens
    got = bf16_gemm.widened(m.packed, m.scales_zeros, first, columns)
    assert got.shape == (k, columns)
    ref = unpacked(m)[16 * first : 16 * first + columns].t()
    assert torch.equal(got.view(torch.int16), ref.contiguous().view(torch.int16))


def test_matmul_agrees_with_the_int8_kernel_and_slices_change_nothing(monkeypatch) -> None:
    m = linear(160, 96, 3)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(4))
    got = bf16_gemm.matmul(x, m.packed, m.scales_zeros)
    ref = x.to(torch.bfloat16) @ unpacked(m).t()
    assert torch.equal(got, ref.float())
    # the int8 kernel rounds x to int8 per group: close, not equal
    kernel = torch.ops.crowdchat.q4_linear(x, m.packed, m.scales_zeros)
    assert ((got - kernel).abs().max() / kernel.abs().max()).item() < 0.02
    monkeypatch.setattr(bf16_gemm, "SLICE", 96 * 32)  # 32 columns at a time: 5 slices
    assert torch.equal(bf16_gemm.matmul(x, m.packed, m.scales_zeros), got)


def test_a_linear_takes_the_bf16_gemm_above_its_rows_only() -> None:
    m = linear(64, 64, 5)
    m.bf16_rows = 8
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(m(x), bf16_gemm.matmul(x, m.packed, m.scales_zeros))
    assert torch.equal(m(x[:8]), torch.ops.crowdchat.q4_linear(x[:8], m.packed, m.scales_zeros))
    assert torch.equal(m(x[None]), m(x)[None])  # [1, T, K] as the model calls it


def test_bad_arguments_are_refused() -> None:
    m = linear(32, 64, 7)
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="blocks out of range"):
        torch.ops.crowdchat.q4_dequant_bf16_(m.packed, m.scales_zeros, out, 1)
    with pytest.raises(RuntimeError, match="out: contiguous bfloat16"):
        torch.ops.crowdchat.q4_dequant_bf16_(m.packed, m.scales_zeros, out.float(), 0)
    with pytest.raises(RuntimeError, match="so: contiguous float32"):
        torch.ops.crowdchat.q4_dequant_bf16_(m.packed, m.scales_zeros[:, :1], out, 0)


def test_rows_above_follows_the_setting() -> None:
    assert bf16_gemm.rows_above(0) == 0  # the default
    assert bf16_gemm.rows_above(64) == (64 if bf16_gemm.available() else 0)


def test_model_logits_on_the_bf16_gemm_stay_within_the_nf4_tolerance(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    """Every prefill of more than one row on the bf16 GEMM against the default: the same top
    token, logits within the tolerance batch shape may move them."""
    linears = [m for m in nf4_model.model.modules() if isinstance(m, Int4Linear) and m.widens]
    if not linears:
        pytest.skip("the model's linears are not on the int8 kernel's AVX-512 layout")
    engine = make_engine(nf4_model, tmp_path)
    engine.shutdown()  # drive the runner directly on this thread
    before = [m.bf16_rows for m in linears]
    mk = lambda: [Sequence(list(p), GREEDY) for p in prompts(formatter)]  # noqa: E731
    try:
        for m in linears:
            m.bf16_rows = 0
        ref = first_step_logits(engine, mk())
        for m in linears:
            m.bf16_rows = 1
        wide = first_step_logits(engine, mk())
    finally:
        for m, rows in zip(linears, before, strict=True):
            m.bf16_rows = rows
    assert not torch.equal(wide, ref)  # the other path did run
    assert_same_top_within_tolerance(wide, ref)
    engine.check_integrity()


def test_the_flag_puts_a_models_linears_on_the_bf16_gemm_and_names_it(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """`--cpu-bf16-above N` on a tiny Llama: its 4-bit linears take the GEMM above N rows,
    the KV fingerprint names it (snapshots never cross), and a prefill of more rows runs."""
    if not bf16_gemm.available():
        pytest.skip("no AMX tiles here: the flag leaves every step on the int8 kernel")
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig
    from engine.model.loader import load_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    directory = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(directory)
    nf4_model.tokenizer.save_pretrained(directory)
    loaded = load_model(EngineConfig(model=str(directory), data_dir=tmp_path, cpu_bf16_above=32))
    linears = [m for m in loaded.model.modules() if isinstance(m, Int4Linear)]
    assert linears and all(m.bf16_rows == 32 for m in linears)
    assert loaded.kernel.endswith("-bf16>32")
    assert "-bf16>32" in loaded.fingerprint(16)["quant"]
    engine = make_engine(loaded, tmp_path)
    engine.shutdown()
    seq = Sequence(list(range(5, 105)), GREEDY)  # 100 rows: past 32
    logits = first_step_logits(engine, [seq])
    assert logits.shape == (1, 1000) and bool(torch.isfinite(logits).all())
    engine.check_integrity()
