"""The CUDA path's paged attention in Triton (engine/kernels/triton_attention.py), run on the CPU
by Triton's interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py without a GPU) against the
textbook attention over each row's gathered context: block boundaries,
GQA groups, ragged and zero lengths, contexts split over several programs, float32 and float16
pools, head sizes that are not powers of two, and prefill chunks after cached tokens."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.chat_format import ChatFormatter
from engine.kernels import triton_attention
from engine.model.loader import LoadedModel, load_model
from tests.model_zoo import build
from tests.rig import make_engine

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k_cache, v_cache, tables, lens, bs: int, scale: float) -> torch.Tensor:  # noqa: ANN001
    """float64 softmax attention of each row over its first `lens` tokens, read block by
    block; zeros for a row of length 0."""
    b, h, d = q.shape
    group = h // k_cache.shape[0]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        if n == 0:
            continue
        slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in range(n)])
        k = k_cache[:, slots.to(k_cache.device)].double().cpu().repeat_interleave(group, 0)
        v = v_cache[:, slots.to(v_cache.device)].double().cpu().repeat_interleave(group, 0)
        s = (q[r].double().cpu()[:, None, :] * k).sum(-1) * scale  # [H, n]
        out[r] = (s.softmax(-1)[:, :, None] * v).sum(1)
    return out


def pool(hkv: int, blocks: int, bs: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """K and V pools [H_kv, blocks * bs, D] of random values."""
    shape = (hkv, blocks * bs, d)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("seed", range(6))
def test_decode_attention_equals_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hkv, group = rng.choice([(1, 1), (3, 3), (2, 4), (4, 1)])
    d = rng.choice([64, 48, 16])
    bs = rng.choice([8, 16])
    dtype = rng.choice([torch.float32, torch.float16])
    rows, nblk = rng.randint(1, 5), rng.randint(1, 9)
    kc, vc = pool(hkv, 64, bs, d, dtype, gen)
    # every row its own blocks, anywhere in the pool; lengths ragged, on and off block
    # boundaries, the table as wide as the longest; one padded row of length 0
    tables = torch.stack([torch.randperm(64, generator=gen)[:nblk] for _ in range(rows)])
    lens = [rng.choice([1, bs, bs + 1, nblk * bs, rng.randint(1, nblk * bs)]) for _ in range(rows)]
    lens[rng.randrange(rows)] = 0 if rows > 1 else lens[0]
    lens = torch.tensor(lens)
    q = torch.randn(rows, hkv * group, d, generator=gen)
    scale = d**-0.5
    want = reference(q, kc, vc, tables, lens, bs, scale)
    for split_tokens in (triton_attention.SPLIT_TOKENS, bs, 2 * bs):  # one split, many
        got = triton_attention.paged_decode_attention(
            q.to(DEVICE), kc, vc, tables.to(DEVICE), lens.to(DEVICE), bs, scale, split_tokens
        )
        assert got.dtype == torch.float32 and got.shape == q.shape
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-4, atol=2e-5)
        half = triton_attention.paged_decode_attention(
            q.to(DEVICE), kc, vc, tables.to(DEVICE), lens.to(DEVICE), bs, scale, split_tokens,
            out_dtype=torch.float16,
        )  # fmt: skip
        assert torch.equal(half, got.to(torch.float16))  # rounded in the kernel as `.to` does


def test_the_kernel_checks_itself_where_it_runs() -> None:
    """The loader's start-up check: the kernel against dense attention on the device, for the
    model's dtypes, head size and GQA group; a failure to build or run is an answer (the
    loader then gathers for SDPA), not a crash."""
    for kv_dtype, d, group in ((torch.float16, 64, 3), (torch.float32, 48, 1)):
        assert triton_attention.self_check(torch.device(DEVICE), kv_dtype, d, group) is None
    why = triton_attention.self_check(torch.device("meta"), torch.float32, 64, 1)
    assert isinstance(why, str) and why


def test_prefill_chunk_after_cached_tokens_is_causal() -> None:
    """Token i of a chunk after `cached` tokens sees exactly cached + i + 1 tokens."""
    gen = torch.Generator().manual_seed(7)
    bs, d, hkv, group, cached, n = 16, 64, 3, 3, 37, 9
    kc, vc = pool(hkv, 16, bs, d, torch.float32, gen)
    blocks = torch.randperm(16, generator=gen)[: -(-(cached + n) // bs)]
    q = torch.randn(n, hkv * group, d, generator=gen)
    got = triton_attention.paged_prefill_attention(
        q.to(DEVICE), kc, vc, blocks.to(DEVICE), cached, bs, 0.125
    )
    tables = blocks[None, :].expand(n, -1)
    lens = torch.arange(cached + 1, cached + n + 1)
    torch.testing.assert_close(
        got.double().cpu(), reference(q, kc, vc, tables, lens, bs, 0.125), rtol=2e-4, atol=2e-5
    )


def test_the_launch_does_not_depend_on_the_lengths() -> None:
    """The same rows and table width with other lengths run the same grid (a captured step
    replays for any lengths within its table): the splits follow the width only."""
    gen = torch.Generator().manual_seed(3)
    kc, vc = pool(2, 32, 16, 64, torch.float32, gen)
    tables = torch.stack([torch.randperm(32, generator=gen)[:8] for _ in range(3)]).to(DEVICE)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    for lens in ([1, 2, 3], [128, 17, 0], [64, 65, 100]):
        lens_t = torch.tensor(lens, device=DEVICE)
        got = triton_attention.paged_decode_attention(q, kc, vc, tables, lens_t, 16, 0.125, 32)
        want = reference(q.cpu(), kc, vc, tables.cpu(), torch.tensor(lens), 16, 0.125)
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-4, atol=2e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/test_cuda.py runs the engine")
def test_the_engine_on_the_triton_kernels_replies_as_on_the_cpu_kernels(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """The runner with `cuda_attention="triton"` (the CUDA path's hooks) on a tiny float32
    Llama, run here in the interpreter: decodes and the later chunks of a chunked prefill
    attend in the Triton kernels and reply token for token as the CPU kernels do, batched."""
    directory = build("llama", tmp_path / "tiny-llama", nf4_model.tokenizer)
    config = EngineConfig(model=str(directory), data_dir=tmp_path, quant="none", dtype="float32")
    loaded = load_model(config)
    fmt = ChatFormatter(loaded.tokenizer)
    prompts = [fmt.encode([{"role": "user", "content": q * 3}]) for q in ("Hi!", "Why is it so?")]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    replies = []
    for attention in ("", "triton"):
        engine = make_engine(
            replace(loaded, cuda_attention=attention),
            tmp_path,
            quant="none",
            dtype="float32",
            model=config.model,
            max_num_batched_tokens=16,  # chunked prefill: later chunks after cached tokens
        )
        calls = {"decode": 0, "prefill": 0}
        runner = engine.runner  # type: ignore[attr-defined]
        if attention:
            assert runner.decode_kernel is triton_attention.paged_decode_attention
            runner.decode_kernel = counted(runner.decode_kernel, calls, "decode")
            runner.prefill_kernel = counted(runner.prefill_kernel, calls, "prefill")
        try:
            replies.append(engine.generate(prompts, greedy))
        finally:
            engine.check_integrity()
            engine.shutdown()
    assert replies[0] == replies[1] and all(len(r) == 6 for r in replies[1])
    assert calls["decode"] > 0 and calls["prefill"] > 0, calls


def counted(kernel, calls: dict[str, int], name: str):  # noqa: ANN001, ANN201
    """`kernel`, counting its calls in `calls[name]`."""

    def call(*args: object) -> torch.Tensor:
        calls[name] += 1
        return kernel(*args)

    return call
