"""Invariant 1: batching never changes results (exactly in float32; within tolerance in nf4)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from engine import SamplingParams
from engine.chat_format import ChatFormatter
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.sequence import Sequence
from tests.conftest import make_engine
from tests.step_logits import QUESTIONS, decode_logits, first_step_logits

GREEDY = SamplingParams(temperature=0, max_new_tokens=64)
# How far (in logit standard deviations) batch shape may move nf4 logits. Measured: 0.11 on a
# 2-core EPYC without AVX512 (float32 compute: FBGEMM's float16 dense copy blocks rows by their
# count, and a step of <= 4 rows takes the int4 kernel; 0.0 with the float32 copies it
# replaced, 2026-12-01); 0.23 on a 2-core Xeon with AMX-BF16 (bf16
# compute: oneDNN blocks a bf16 GEMM by its row count, and a step of <= 16 rows takes the int4
# kernel, more rows the dense copy); 0.74 for bitsandbytes' CUDA kernels on an H200. The
# quantization itself moves them up to 3 deviations from float32, and a real batching bug (a
# wrong mask or slot) by whole deviations: 0.5 tells those apart from rounding.
NF4_TOLERANCE = 0.5


def prompts(formatter: ChatFormatter) -> list[list[int]]:
    out = [formatter.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in out}) >= 6, "prompts should differ in length"
    return out


def test_fp32_batched_equals_solo_equals_transformers_generate(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    formatter = ChatFormatter(fp32_model.tokenizer)
    ps = prompts(formatter)
    engine = make_engine(fp32_model, tmp_path)
    try:
        batched = engine.generate(ps, GREEDY)
        assert engine.stats().max_batch_seen == 8
        solo = [engine.generate([p], GREEDY)[0] for p in ps]
    finally:
        engine.shutdown()
    assert batched == solo
    model = fp32_model.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            for p, mine in zip(ps, batched, strict=True):
                ref = model.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False)
                assert mine == ref[0, len(p) :].tolist()
    finally:
        model.set_attn_implementation("crowdchat_paged")


def test_nf4_batched_logits_match_solo_within_tolerance(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    """In bf16 the matmul's summation order may change with batch shape, so batched and solo
    logits may differ by rounding; the top token must not. Bound: NF4_TOLERANCE logit standard
    deviations (see its comment for what was measured where)."""
    ps = prompts(formatter)
    engine = make_engine(nf4_model, tmp_path)
    engine.shutdown()  # drive the runner directly on this thread
    mk = lambda: [Sequence(list(p), GREEDY) for p in ps]  # noqa: E731
    batched = first_step_logits(engine, mk())
    solo = torch.cat([first_step_logits(engine, [s]) for s in mk()])
    assert_same_top_within_tolerance(batched, solo)
    # a decode step of 8 rows runs the dense copy (above --cpu-dense-above's 4 with FBGEMM's
    # float16), each alone the packed kernel
    dec_batched = decode_logits(engine, mk())
    dec_solo = torch.cat([decode_logits(engine, [s]) for s in mk()])
    assert_same_top_within_tolerance(dec_batched, dec_solo)
    engine.check_integrity()


def assert_same_top_within_tolerance(batched: torch.Tensor, solo: torch.Tensor) -> None:
    """Logits within NF4_TOLERANCE deviations, and the same top token, unless solo's top two
    lie closer than the rounding measured on that row (a near tie may fall either way)."""
    spread = solo.std(dim=-1, keepdim=True)
    assert ((batched - solo).abs() / spread).max() < NF4_TOLERANCE
    noise = (batched - solo).abs().amax(dim=-1)
    top = batched.argmax(-1)
    for row in range(len(solo)):
        gap = solo[row].max() - solo[row, top[row]]
        assert gap <= 2 * noise[row], (row, gap.item(), noise[row].item())


def test_fp32_chunked_prefill_changes_nothing(fp32_model: LoadedModel, tmp_path: Path) -> None:
    """A prompt prefilled in 64-token chunks while another user decodes gives the same
    greedy reply as the same prompt prefilled at once."""
    formatter = ChatFormatter(fp32_model.tokenizer)
    long_prompt = formatter.encode([{"role": "user", "content": " ".join(QUESTIONS) * 2}])
    assert len(long_prompt) > 200
    whole = make_engine(fp32_model, tmp_path)
    try:
        expected = whole.generate([long_prompt], GREEDY)[0]
    finally:
        whole.shutdown()
    chunked = make_engine(fp32_model, tmp_path, max_num_batched_tokens=64)
    try:
        other = chunked.submit(
            prompts(formatter)[0], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
        )
        next(iter(other))  # decoding while the long prompt is chunked in
        assert chunked.generate([long_prompt], GREEDY)[0] == expected
        other.result()
        assert chunked.stats().steps > len(long_prompt) // 64
    finally:
        chunked.shutdown()


def test_fp32_prompts_admitted_at_the_end_of_a_small_budget_change_nothing(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    """With a 32-token budget, a 31-token prompt leaves 1 token for the next one admitted in
    the same step: that token must be a prefill chunk, never sampled as a reply token."""
    formatter = ChatFormatter(fp32_model.tokenizer)
    long_prompt = formatter.encode([{"role": "user", "content": " ".join(QUESTIONS)}])
    first, second = long_prompt[:31], prompts(formatter)[1]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    engine = make_engine(fp32_model, tmp_path, max_num_batched_tokens=32)
    try:
        solo = [engine.generate([p], params)[0] for p in (first, second)]
        gate = threading.Event()
        # hold the engine thread so both prompts are admitted in one step
        holder = threading.Thread(target=engine._call, args=(lambda: gate.wait(10),))
        holder.start()
        handles = [engine.submit(p, params) for p in (first, second)]
        gate.set()
        holder.join()
        assert [h.result() is not None and h.token_ids for h in handles] == solo
    finally:
        engine.shutdown()


def continue_conversation(
    engine, formatter: ChatFormatter, owner: str | None, reply: str
) -> list[int]:
    conv = [
        {"role": "user", "content": QUESTIONS[3]},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": QUESTIONS[5]},
    ]
    h = engine.submit(formatter.encode(conv), GREEDY, owner=owner, retain=owner is not None)
    h.result()
    return h.token_ids, h.num_cached_tokens


def test_fp32_a_continuation_on_reused_or_restored_kv_equals_a_cold_recompute(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    formatter = ChatFormatter(fp32_model.tokenizer)
    engine = make_engine(fp32_model, tmp_path)
    try:
        first = formatter.encode([{"role": "user", "content": QUESTIONS[3]}])
        turn = engine.submit(first, GREEDY, owner="s", retain=True)
        reply = turn.result()
        cold, cached = continue_conversation(engine, formatter, None, reply)
        assert cached == 0
        kv = engine.export_kv("s")
        assert engine.drop_kv("s") and engine.import_kv("s", kv)  # as a restore does
        warm, cached = continue_conversation(engine, formatter, "s", reply)
        assert cached >= len(first)  # the first turn's KV was reused, not recomputed
        assert warm == cold
    finally:
        engine.shutdown()


def test_nf4_logits_on_reused_kv_match_a_cold_prefill_within_tolerance(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    """Reusing KV means the new tokens are prefilled after a cached prefix, like a second
    chunk: their logits must match one whole prefill (tolerance as for batching above)."""
    engine = make_engine(nf4_model, tmp_path)
    engine.shutdown()  # drive the runner directly on this thread
    p = prompts(formatter)[7]
    whole = first_step_logits(engine, [Sequence(list(p), GREEDY)])
    seq = Sequence(list(p), GREEDY)
    seq.block_table = engine.pool.allocate(engine.pool.blocks_for(seq.num_tokens))
    try:
        cut = len(p) // 2
        engine.runner.forward(StepPlan(prefills=[(seq, cut)]))  # the cached prefix
        seq.num_computed = cut
        reused = engine.runner.forward(StepPlan(prefills=[(seq, len(p) - cut)])).float()
    finally:
        engine.pool.free(seq.block_table)
    assert_same_top_within_tolerance(reused, whole)
    engine.check_integrity()
