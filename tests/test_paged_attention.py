"""Decode attention on the CPU reads each sequence's own blocks (engine.kernels.cpu_kernels); where
it gathers instead (CUDA, no kernel) it groups decodes by context length, so one long conversation
costs its own context. Either way the logits change by rounding only. A short prefill chunk after
cached tokens attends on the CPU kernel too (every chunk there), as its gather path to rounding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.model import runner as model_runner
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.model.runner import decode_groups
from engine.sequence import Sequence
from tests.conftest import make_engine
from tests.step_logits import decode_logits

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def test_similar_lengths_share_one_group() -> None:
    assert decode_groups([100, 110, 120, 130], 16) == [(0, 4)]
    assert decode_groups([], 16) == []


def test_a_very_long_context_gets_a_group_of_its_own() -> None:
    assert decode_groups([120] * 31 + [6000], 16) == [(0, 31), (31, 32)]


def test_no_group_pads_more_than_a_quarter_beyond_its_tokens_or_a_small_slack() -> None:
    rng = random.Random(7)
    for _ in range(200):
        lens = sorted(rng.choice([rng.randint(1, 200), rng.randint(1, 8000)]) for _ in range(40))
        groups = decode_groups(lens, 16)
        assert groups[0][0] == 0 and groups[-1][1] == len(lens)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
        for lo, hi in groups:
            real = sum(lens[lo:hi])
            padded = (hi - lo) * -(-lens[hi - 1] // 16) * 16
            assert padded - real <= max(0.25 * real, model_runner.MIN_SPLIT_WASTE)


def test_the_runner_pads_short_decodes_only_to_their_own_group(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    engine = make_engine(fp32_model, tmp_path, kv_budget_mb=256)
    engine.shutdown()
    seqs = [Sequence(list(range(10, 10 + n)), GREEDY) for n in (40, 3000, 50, 45)]
    for s in seqs:
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens + 1))
        s.num_computed = s.num_tokens - 1
    kernel = engine.runner.decode_kernel
    try:
        assert kernel is not None  # built by make (engine.kernels.cpu_kernels)
        meta, _, _, _ = engine.runner._metadata(StepPlan(decodes=seqs))
        # the kernel reads each one's own blocks: one group, no padding
        [whole] = meta.decode_groups
        assert (whole.start, whole.end, whole.pad) == (0, 4, None)
        assert whole.lens.tolist() == [40, 45, 50, 3000]
        engine.runner.decode_kernel = None
        meta, ids, pos, rows = engine.runner._metadata(StepPlan(decodes=seqs))
    finally:
        engine.runner.decode_kernel = kernel
        for s in seqs:
            engine.pool.free(s.block_table)
    assert [(g.start, g.end, g.blocks.shape[1]) for g in meta.decode_groups] == [
        (0, 3, 4),
        (3, 4, 188),
    ]
    assert pos == [39, 44, 49, 2999]  # sorted by context length
    assert [pos[r] for r in rows] == [s.num_computed for s in seqs]  # logits in plan order


@pytest.mark.parametrize("seed", [1])
def test_fp32_decode_logits_agree_between_the_kernel_the_gather_paths_and_solo_runs(
    fp32_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Random context lengths, one of them very long: the kernel's step, the gather grouped
    by length, one group padded to the longest, and each sequence decoded alone agree in
    argmax and to rounding: a batch of one runs the linears through other BLAS kernels, and
    SDPA's kernel blocks the context, so padding moves its rounding (measured on the 2-core
    AVX2 EPYC: 1.3e-5 and 2.8e-5 of the logits' std)."""
    rng = random.Random(seed)
    lens = [rng.randint(3, 300) for _ in range(9)] + [rng.randint(1500, 2000)]
    rng.shuffle(lens)
    toks = [[rng.randrange(100, 40000) for _ in range(n)] for n in lens]
    engine = make_engine(fp32_model, tmp_path, kv_budget_mb=512)
    engine.shutdown()  # drive the runner directly on this thread

    def mk() -> list[Sequence]:
        return [Sequence(list(t), GREEDY) for t in toks]

    kernel = decode_logits(engine, mk())
    assert engine.runner.decode_kernel is not None
    engine.runner.decode_kernel = None
    grouped = decode_logits(engine, mk())
    assert len(decode_groups(sorted(n + 1 for n in lens), 16)) >= 2
    solo = torch.cat([decode_logits(engine, [s]) for s in mk()])
    monkeypatch.setattr(model_runner, "decode_groups", lambda ls, bs: [(0, len(ls))] if ls else [])
    padded = decode_logits(engine, mk())
    for other in (kernel, padded, solo):
        assert torch.equal(grouped.argmax(-1), other.argmax(-1))
        assert ((grouped - other).abs() / other.std(dim=-1, keepdim=True)).max() < 1e-4
    engine.check_integrity()


@pytest.mark.parametrize("chunk", [1, 23, 150])
def test_fp32_a_chunk_after_cached_tokens_agrees_on_the_kernel_and_the_gather(
    fp32_model: LoadedModel, tmp_path: Path, chunk: int
) -> None:
    """A returning user's message: a chunk prefilled after ~1,500 cached tokens attends on the
    CPU kernel (`paged_prefills_attention`), whatever its size; its logits agree
    with the gather and SDPA path in argmax and to rounding, and so does the K/V it leaves."""
    rng = random.Random(chunk)
    toks = [rng.randrange(100, 40000) for _ in range(1500 + chunk)]
    engine = make_engine(fp32_model, tmp_path, kv_budget_mb=512)
    engine.shutdown()  # drive the runner directly on this thread
    runner, calls = engine.runner, []
    kernel = runner.prefills_kernel
    assert kernel is not None

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return kernel(*args)

    def run(attend: object) -> tuple[torch.Tensor, torch.Tensor]:
        s = Sequence(list(toks), GREEDY)
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens))
        try:
            runner.prefills_kernel = kernel  # the same cached K/V for both
            runner.forward(StepPlan(prefills=[(s, 1500)]))
            s.num_computed = 1500
            runner.prefills_kernel = attend
            logits = runner.forward(StepPlan(prefills=[(s, chunk)])).float()
            return logits, engine.cache.export(s.block_table, s.num_tokens)[0]
        finally:
            engine.pool.free(s.block_table)

    try:
        (fast, k_fast), (gathered, k_gathered) = run(counted), run(None)
    finally:
        runner.prefills_kernel = kernel
    assert calls == [chunk] * fp32_model.num_layers
    assert torch.equal(fast.argmax(-1), gathered.argmax(-1))
    assert ((fast - gathered).abs() / gathered.std(dim=-1, keepdim=True)).max() < 1e-4
    assert torch.equal(k_fast[:, :1500], k_gathered[:, :1500])
    assert (k_fast - k_gathered).abs().max() < 1e-3 * k_gathered.abs().max()
    engine.check_integrity()


def test_fp32_a_steps_chunks_share_one_kernel_call_bitwise_each_alone(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    """New prompts and messages after cached tokens, short and long, in random mixes: all of
    a step's chunks are one `paged_prefills_attention` call a layer (whose values are bitwise
    each chunk's alone: tests/test_cpu_kernels.py); the logits agree with each chunk
    prefilled alone and with the SDPA path in argmax and to rounding."""
    engine = make_engine(fp32_model, tmp_path, kv_budget_mb=512)
    engine.shutdown()
    runner, rng = engine.runner, random.Random(9)
    kernel = runner.prefills_kernel
    assert kernel is not None
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(len(args[4]))
        return kernel(*args)

    def step(chunks: list[tuple[list[int], int, int]], attend: object = kernel) -> torch.Tensor:
        """Logits of the chunks (tokens, cached, new) in one step attended by `attend`, the
        cached parts first (each alone)."""
        seqs = []
        for toks, cached, _ in chunks:
            s = Sequence(list(toks), GREEDY)
            s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens))
            if cached:
                runner.forward(StepPlan(prefills=[(s, cached)]))
                s.num_computed = cached
            seqs.append(s)
        runner.prefills_kernel = attend
        try:
            plan = StepPlan(prefills=[(s, n) for s, (*_, n) in zip(seqs, chunks, strict=True)])
            return runner.forward(plan)
        finally:
            runner.prefills_kernel = kernel
            for s in seqs:
                engine.pool.free(s.block_table)

    for trial in range(3):
        chunks = []
        for _ in range(rng.randint(2, 5)):
            cached = rng.choice([0, 0, rng.randint(1, 200)])
            n = rng.choice([1, 9, 22, 64, 65, 150]) if chunks else rng.choice([1, 9, 22])
            chunks.append(([rng.randrange(100, 40000) for _ in range(cached + n)], cached, n))
        calls.clear()
        together = step(chunks, counted).float()
        assert calls == [len(chunks)] * fp32_model.num_layers, (trial, calls)
        alone = torch.cat([step([c]).float() for c in chunks])
        sdpa = step(chunks, None).float()
        for other in (alone, sdpa):  # (float32 matmuls round by their batch's shape)
            assert torch.equal(together.argmax(-1), other.argmax(-1)), trial
            assert ((together - other).abs() / other.std(dim=-1, keepdim=True)).max() < 1e-4
    engine.check_integrity()
