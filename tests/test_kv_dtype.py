"""The KV pool's dtype: bfloat16 where PyTorch's CPU kernels run a float32 model (their
outputs are bfloat16 already, so V is stored exactly), else the compute dtype."""

from __future__ import annotations

import pytest
import torch

import engine.model.lean_llama as lean_llama
from engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from engine.chat_format import ChatFormatter
from engine.model.kv_cache import bytes_per_token
from engine.model.loader import LoadedModel, resolve_kv_dtype

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("name", "dtype", "cpu_kernels", "expected"),
    [
        ("auto", F32, True, BF16),  # CPU --quant on a CPU without native bf16
        ("auto", F32, False, F32),  # --quant none: float32 stays exact end to end
        ("auto", BF16, True, BF16),
        ("auto", torch.float16, False, torch.float16),  # CUDA without bf16
        ("float32", F32, True, F32),  # the operator's choice stays
        ("float16", BF16, False, torch.float16),
    ],
)
def test_resolve_kv_dtype(
    name: str, dtype: torch.dtype, cpu_kernels: bool, expected: torch.dtype
) -> None:
    assert resolve_kv_dtype(name, dtype, cpu_kernels) == expected


def test_kv_dtype_flag_is_checked() -> None:
    with pytest.raises(InvalidRequest, match="--kv-dtype"):
        EngineConfig(kv_dtype="int8")


def test_quantized_cpu_pool_is_bf16_at_half_the_bytes(
    nf4_model: LoadedModel, fp32_model: LoadedModel
) -> None:
    assert nf4_model.kv_dtype == BF16  # float32 or bf16 compute: PyTorch's kernels on CPU
    assert fp32_model.kv_dtype == F32
    assert 2 * bytes_per_token(nf4_model) == bytes_per_token(fp32_model)
    # a snapshot written from a float32 pool is not taken for one of this pool
    assert nf4_model.fingerprint(16)["kv_dtype"] == "bfloat16"
    assert fp32_model.fingerprint(16)["kv_dtype"] == "float32"


def test_values_reach_the_pool_exactly(
    nf4_engine: Engine, formatter: ChatFormatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes a bf16 pool lossless for V: on the kernels (few rows) and on the dense copies
    (a prefill of many rows) every value the projections give is a bfloat16 number."""
    seen: list[bool] = []
    rows: set[int] = set()
    attend = lean_llama.paged_attention

    def watch(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.equal(value, value.to(BF16).to(value.dtype)))
        rows.add(value.shape[2])
        return attend(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(lean_llama, "paged_attention", watch)
    # decodes and the prompt through `forward`'s loop and its tensor-op glue, where paged
    # attention sees the values (the kernels' decode path, `prompt_stack` and `_cpu_attention`
    # write bitwise the same K/V: tests/test_lean_llama.py)
    monkeypatch.setattr(nf4_engine.runner.lean, "kernel_decodes", False)
    monkeypatch.setattr(nf4_engine.runner.lean, "cpu_glue", False)
    monkeypatch.setattr(nf4_engine.runner.lean, "prompt_stacks", False)
    ids = formatter.encode([{"role": "user", "content": "Name three colours."}])
    h = nf4_engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=4))
    list(h)
    assert seen and all(seen)
    assert 1 in rows and max(rows) > 16  # decodes (kernel) and the prefill (dense copy) ran
    assert nf4_engine.cache.data.dtype == BF16
