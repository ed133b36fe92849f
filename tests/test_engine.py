"""The engine end to end on the real model: streaming, a tiny pool, cancel, errors, threads.
Sampling options are tests/test_engine_sampling.py's, KV export and import
tests/test_engine_kv.py's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine import (
    Engine,
    EngineStopped,
    FinishReason,
    InvalidRequest,
    PromptTooLong,
    RequestFailed,
    SamplingParams,
    ServerBusy,
)
from engine.chat_format import ChatFormatter
from engine.kernels import cpu_kernels
from engine.model.kv_cache import bytes_per_token
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.model.runner import PROMPT_SERIAL_PAIRS, PROMPT_SERIAL_ROWS, SERIAL_ROWS, ModelRunner
from engine.threads import run_in_fresh_thread
from tests.conftest import ask, make_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def test_streams_a_sensible_reply(nf4_engine: Engine, formatter: ChatFormatter) -> None:
    h = nf4_engine.submit(
        ask(formatter, "What is the capital of France? Answer in one sentence."),
        SamplingParams(temperature=0, max_new_tokens=16),
    )
    deltas = list(h)
    assert len(deltas) > 3 and "Paris" in "".join(deltas)
    assert (
        h.text
        == "".join(deltas)
        == nf4_engine.tokenizer.decode(h.token_ids, skip_special_tokens=True)
    )
    assert h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_stream_is_exact_across_multibyte_characters(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    """Deltas never contain half a character, and together they are the decoded reply (one
    cut off mid-character by `max_new_tokens` ends at its last whole character). Sampled
    replies differ with the CPU's kernels (bfloat16 or int8 activations): a few seeds, at
    least one of which streams 4-byte characters."""
    four_byte = False
    for seed in range(3, 11):
        h = nf4_engine.submit(
            ask(formatter, "Reply with emoji only: 🎉🐍🚀 and the word naïve"),
            SamplingParams(temperature=0.9, seed=seed, max_new_tokens=48),
        )
        deltas = list(h)
        assert all("\ufffd" not in d for d in deltas)
        decoded = nf4_engine.tokenizer.decode(h.token_ids, skip_special_tokens=True)
        assert "".join(deltas) == h.text == decoded.rstrip("\ufffd")
        four_byte = any(ord(c) > 0xFFFF for c in h.text)
        if four_byte:
            break
    assert four_byte  # 4-byte characters did stream


def test_tiny_pool_completes_everything_by_queueing_and_preemption(
    fp32_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    """Float32, where batching and recompute after preemption change nothing, so the ten
    identical greedy requests must agree token for token (in bf16 the step's shape may move
    a near tie)."""
    # 6 blocks of 16 tokens: room for about two of these conversations at a time
    engine = make_engine(
        fp32_model,
        tmp_path,
        max_model_len=96,
        kv_budget_mb=6 * 16 * bytes_per_token(fp32_model) / 2**20,
    )
    try:
        assert engine.pool.num_blocks == 6
        p = formatter.encode(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        )
        sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
        handles = [engine.submit(p, sp) for _ in range(10)]
        for h in handles:
            h.result()
            assert h.finish_reason is FinishReason.LENGTH and h.num_generated_tokens == 40
        assert len({tuple(h.token_ids) for h in handles}) == 1  # greedy: all identical
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.requests_finished == 10
        assert stats.blocks_used == 0 and stats.blocks_free == 6
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_cancel_frees_blocks_at_once(nf4_engine: Engine, formatter: ChatFormatter) -> None:
    h = nf4_engine.submit(
        ask(formatter, "Tell me a long story."),
        SamplingParams(temperature=0, max_new_tokens=2000, ignore_eos=True),
    )
    it = iter(h)
    next(it)
    assert nf4_engine.stats().blocks_used > 0
    h.cancel()
    list(it)  # the stream ends after the cancel, without an error
    assert h.finish_reason is FinishReason.CANCELLED and len(h.token_ids) < 2000
    nf4_engine.check_integrity()  # runs after the cancel message on the engine thread
    assert nf4_engine.stats().blocks_used == 0


def test_bad_requests_get_clear_errors_while_others_continue(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    engine = make_engine(nf4_model, tmp_path, max_queue=2, max_num_seqs=1, max_model_len=256)
    try:
        busy = engine.submit(
            ask(formatter, "Hello"),
            SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True),
        )
        next(iter(busy))  # it runs now, taking the only batch slot
        with pytest.raises(InvalidRequest, match="empty"):
            engine.submit([])
        with pytest.raises(PromptTooLong, match="at most 255"):
            engine.submit([5] * 300)
        with pytest.raises(InvalidRequest, match="invalid token"):
            engine.submit([1, -4, 10**9])
        with pytest.raises(InvalidRequest, match="temperature"):
            SamplingParams(temperature=-1)
        with pytest.raises(InvalidRequest, match="max_new_tokens"):
            SamplingParams(max_new_tokens=0)
        with pytest.raises(InvalidRequest, match="top_p"):
            SamplingParams(top_p=float("nan"))
        queued = [engine.submit(ask(formatter, "Hi"), GREEDY) for _ in range(2)]
        with pytest.raises(ServerBusy, match="busy"):
            engine.submit(ask(formatter, "Hi"), GREEDY)
        assert engine.stats().requests_rejected >= 1
        for h in [busy, *queued]:
            h.result()
            assert h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    finally:
        engine.shutdown()


class ExplodingOnce:
    """The real model runner, except that its first step raises."""

    def __init__(self, loaded: LoadedModel, cache: object, max_model_len: int) -> None:
        self.inner = ModelRunner(loaded, cache, max_model_len)  # type: ignore[arg-type]
        self.stop_ids = self.inner.stop_ids
        self.calls = 0

    def run(self, plan: StepPlan) -> dict:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected fault")
        return self.inner.run(plan)


def test_a_crashing_step_fails_only_its_requests(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    engine = make_engine(nf4_model, tmp_path, runner=ExplodingOnce)
    try:
        victim = engine.submit(ask(formatter, "Hi"), GREEDY)
        with pytest.raises(RequestFailed, match="injected fault"):
            victim.result()
        assert victim.finish_reason is FinishReason.ERROR
        after = engine.submit(
            ask(formatter, "What is the capital of France? Answer in one sentence."), GREEDY
        )
        assert "Paris" in after.result()
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_dead_engine_thread_fails_everything_and_refuses_new_work(
    nf4_engine: Engine, formatter: ChatFormatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = nf4_engine.scheduler.schedule

    def broken(budget: int) -> object:
        gate.wait(5)
        raise MemoryError("injected outside the step's try")

    waiting = nf4_engine.submit(ask(formatter, "Hi"), GREEDY)
    monkeypatch.setattr(nf4_engine.scheduler, "schedule", broken)
    gate.set()
    with pytest.raises(RequestFailed, match="engine failed"):
        waiting.result()  # would wait forever if the thread just died
    with pytest.raises(EngineStopped, match="engine failed"):
        nf4_engine.submit(ask(formatter, "Hi"), GREEDY)
    stats = nf4_engine.stats()
    assert not stats.alive and "MemoryError" in (stats.failure or "")
    assert nf4_engine.resident_kv() == {}  # calls still answer
    monkeypatch.setattr(nf4_engine.scheduler, "schedule", real)


def test_a_few_row_step_runs_on_the_engine_thread_alone_unless_it_splits_columns(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    """Up to SERIAL_ROWS rows a CPU step wakes no other thread (its kernels see one OpenMP
    thread), unless its decode steps split their matmuls' columns over the threads
    (`LeanLlama.shared_decodes`: the int8-activation kernels), where one row has them all; a
    bigger step has them all, as every thread starts with. A step with prompt tokens runs
    alone up to PROMPT_SERIAL_ROWS rows on the AVX512-VNNI kernels, unless its attention has
    PROMPT_SERIAL_PAIRS (query, key) pairs."""
    threads = run_in_fresh_thread(torch.get_num_threads)
    assert threads > 1, "the suite runs where torch has more than one thread"
    runner = nf4_engine.runner
    shared = bool(getattr(runner.lean, "shared_decodes", False))
    assert shared == cpu_kernels.q8_activations()
    nf4_engine.submit(ask(formatter, "Hi"), SamplingParams(max_new_tokens=3)).result()
    # its last step: one decode row
    assert nf4_engine._call(torch.get_num_threads) == (threads if shared else 1)
    bigger = lambda: runner._use_threads(SERIAL_ROWS + 1) or torch.get_num_threads()  # noqa: E731
    assert nf4_engine._call(bigger) == threads

    def prompt_step(rows: int, pairs: int = 0) -> int:  # a step with prompt tokens: op by op
        runner._use_threads(rows, prompt=True, pairs=pairs)
        return torch.get_num_threads()

    alone = PROMPT_SERIAL_ROWS if shared and cpu_kernels.q4_dot_layout() else SERIAL_ROWS
    assert nf4_engine._call(lambda: prompt_step(alone)) == 1
    assert nf4_engine._call(lambda: prompt_step(alone + 1)) == threads
    # a message after a long conversation: its attention over the threads
    long_context = PROMPT_SERIAL_PAIRS
    assert nf4_engine._call(lambda: prompt_step(alone, long_context - 1)) == 1
    assert nf4_engine._call(lambda: prompt_step(SERIAL_ROWS + 1, long_context)) == threads
    assert nf4_engine._call(lambda: prompt_step(SERIAL_ROWS, long_context)) == 1

    def one_row_split_by_rows() -> int:
        lean, runner.lean = runner.lean, None  # no column split: the rows' bound holds
        try:
            runner._use_threads(1)
            return torch.get_num_threads()
        finally:
            runner.lean = lean

    assert nf4_engine._call(one_row_split_by_rows) == 1
    assert run_in_fresh_thread(torch.get_num_threads) == threads  # other threads untouched


def test_submit_from_many_threads_batches_them(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    results: list[str] = []

    def user(i: int) -> None:
        results.append(nf4_engine.submit(ask(formatter, f"Say the number {i}."), GREEDY).result())

    threads = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(results)
    assert nf4_engine.stats().max_batch_seen > 1


def test_stats_report_latencies_and_throughput(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    nf4_engine.generate([ask(formatter, "Hi")] * 4, GREEDY)
    time.sleep(0.01)
    s = nf4_engine.stats()
    assert s.ttft_p50_s and s.ttft_p50_s > 0 and s.itl_p50_s and s.itl_p95_s >= s.itl_p50_s
    assert s.tokens_per_s > 0 and s.generated_tokens_total >= 4
    assert s.blocks_total == s.blocks_used + s.blocks_free


def test_a_long_prompt_alone_is_prefilled_in_chunks(
    nf4_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    engine = make_engine(nf4_model, tmp_path, max_num_batched_tokens=32)
    try:
        p = ask(formatter, "Please summarize: " + "the quick brown fox jumps. " * 30)
        h = engine.submit(p, GREEDY)
        assert h.result() and h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert engine.stats().steps >= len(p) // 32
    finally:
        engine.shutdown()
