"""The engine end to end on the real model: streaming, limits, errors, cancel, KV export."""

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
    KVFileDamaged,
    PromptTooLong,
    RequestFailed,
    SamplingParams,
    ServerBusy,
)
from engine.chat_format import ChatFormatter
from engine.model.kv_cache import bytes_per_token
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.model.runner import SERIAL_ROWS, ModelRunner
from engine.threads import run_in_fresh_thread
from sessions.snapshots import SnapshotFiles
from tests.conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def ask(formatter: ChatFormatter, text: str) -> list[int]:
    return formatter.encode([{"role": "user", "content": text}])


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


def test_stop_string_ends_the_reply_and_is_not_shown(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    p = ask(formatter, "Count from 1 to 20, separated by commas.")
    full = nf4_engine.submit(p, SamplingParams(temperature=0, max_new_tokens=60)).result()
    assert "5" in full
    stop_at = full.index("5")
    h = nf4_engine.submit(p, SamplingParams(temperature=0, max_new_tokens=60, stop=("5",)))
    text = h.result()
    assert h.finish_reason is FinishReason.STOP
    assert text == full[:stop_at]


def test_seed_makes_sampling_reproducible(nf4_engine: Engine, formatter: ChatFormatter) -> None:
    p = ask(formatter, "Write a short poem about rain.")
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_new_tokens=20)
    # one at a time, each from a cold cache, so both run the very same steps: in bf16 a
    # request batched with its twin, or started on cached blocks, may round its logits
    # differently, and sampling at temperature 1 turns that into another poem (seen in CI)
    a = nf4_engine.submit(p, sp)
    a.result()
    nf4_engine.reset_prefix_cache()
    b = nf4_engine.submit(p, sp)
    assert a.result() == b.result() and a.token_ids == b.token_ids
    c = nf4_engine.submit(p, SamplingParams(temperature=1.0, seed=99, max_new_tokens=20))
    c.result()
    assert c.token_ids != a.token_ids


def test_a_frequency_penalty_curbs_a_repeating_reply_beside_an_unpenalized_twin(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    # greedy, the model loops ("cat, cat, cat, ...": one token 17 times in 40)
    p = ask(formatter, "Write the word cat forty times, separated by spaces.")
    plain = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    penal = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, frequency_penalty=2)
    # the same prompt, penalized and not, in one batch (the sampler's tests check that a
    # penalized row leaves its batch mates' logits alone)
    a, b = nf4_engine.submit(p, plain), nf4_engine.submit(p, penal)
    a.result(), b.result()

    def most_repeated(ids: list[int]) -> int:
        return max(ids.count(t) for t in set(ids))

    assert most_repeated(b.token_ids) < most_repeated(a.token_ids)
    assert len(set(b.token_ids)) > len(set(a.token_ids))


def test_max_new_tokens_and_ignore_eos(nf4_engine: Engine, formatter: ChatFormatter) -> None:
    h = nf4_engine.submit(
        ask(formatter, "Say hi."), SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    h.result()
    assert h.num_generated_tokens == 40 and h.finish_reason is FinishReason.LENGTH


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

    def __init__(self, loaded: LoadedModel, cache: object) -> None:
        self.inner = ModelRunner(loaded, cache)  # type: ignore[arg-type]
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


def test_min_tokens_works_on_a_float32_model(
    fp32_model: LoadedModel, formatter: ChatFormatter, tmp_path: Path
) -> None:
    engine = make_engine(fp32_model, tmp_path)
    try:
        for temperature in (0.0, 0.8):
            h = engine.submit(
                ask(formatter, "Say nothing."),
                SamplingParams(temperature=temperature, min_new_tokens=6, max_new_tokens=8, seed=1),
            )
            h.result()
            assert h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert len(h.token_ids) >= 6
    finally:
        engine.shutdown()


def test_a_failed_kv_import_leaks_no_blocks(
    nf4_engine: Engine, formatter: ChatFormatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    nf4_engine.submit(ask(formatter, "Hi"), GREEDY, owner="s", retain=True).result()
    kv = nf4_engine.export_kv("s")
    nf4_engine.drop_kv("s")

    def broken(*args: object) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(nf4_engine.cache, "load", broken)
    with pytest.raises(RuntimeError, match="injected"):
        nf4_engine.import_kv("s", kv)
    nf4_engine.check_integrity()
    assert nf4_engine.stats().blocks_used == 0


@pytest.mark.parametrize("reader", ["kernel", "python"])
def test_kv_imported_from_a_file_is_exact_shares_the_cached_head_and_damage_leaks_nothing(
    nf4_engine: Engine, formatter: ChatFormatter, tmp_path: Path, reader: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A snapshot file back into the pool, read straight into reserved blocks off the engine
    thread (the CPU kernel) or read into memory first (CUDA, or no kernels): byte-exact, its
    head found in the prefix cache is shared instead of read, and a flipped byte or a short
    file raises KVFileDamaged with every block let go."""
    conv = [{"role": "user", "content": "Name three rivers and a mountain."}]
    nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s", retain=True, cache_ns="u").result()
    kv = nf4_engine.export_kv("s")
    files = SnapshotFiles(tmp_path / "snapshots")
    files.write("s", kv.token_ids, kv.k, kv.v, nf4_engine.kv_fingerprint)
    where = files.kv_file("s", nf4_engine.kv_fingerprint)
    assert where is not None and where.shape == tuple(kv.k.shape)
    assert nf4_engine.cache.reads_files(where)  # the kernels are built (make kernel)
    if reader == "python":
        monkeypatch.setattr(nf4_engine.cache, "reads_files", lambda kv: False)
    resident = nf4_engine.scheduler.resident
    for shared in (True, False):  # the blocks the first turn cached (namespace "u"), or none
        nf4_engine.drop_kv("s")
        if not shared:
            nf4_engine.reset_prefix_cache()
        before = resident.num_loaded_from_cache
        assert nf4_engine.import_kv_file("s", where, cache_ns="u" if shared else None)
        assert (resident.num_loaded_from_cache > before) == shared
        again = nf4_engine.export_kv("s")
        assert again.token_ids == kv.token_ids
        assert torch.equal(again.k.view(torch.int16), kv.k.view(torch.int16))
        assert torch.equal(again.v.view(torch.int16), kv.v.view(torch.int16))
        nf4_engine.check_integrity()
    nf4_engine.drop_kv("s")
    nf4_engine.reset_prefix_cache()
    raw = bytearray(where.path.read_bytes())
    raw[where.v_at + len(raw[where.v_at :]) // 2] ^= 0x40
    for damaged in (bytes(raw), bytes(raw[: where.v_at + 10])):
        where.path.write_bytes(damaged)
        with pytest.raises(KVFileDamaged):
            nf4_engine.import_kv_file("s", where)
        nf4_engine.check_integrity()
        assert "s" not in nf4_engine.resident_kv() and nf4_engine.stats().blocks_used == 0


def test_a_few_row_step_runs_on_the_engine_thread_alone(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    """Up to SERIAL_ROWS rows a CPU step wakes no other thread (its kernels see one OpenMP
    thread); a bigger step has them all, as every thread starts with."""
    threads = run_in_fresh_thread(torch.get_num_threads)
    assert threads > 1, "the suite runs where torch has more than one thread"
    nf4_engine.submit(ask(formatter, "Hi"), SamplingParams(max_new_tokens=3)).result()
    assert nf4_engine._call(torch.get_num_threads) == 1  # its last step: one decode row
    runner = nf4_engine.runner
    bigger = lambda: runner._use_threads(SERIAL_ROWS + 1) or torch.get_num_threads()  # noqa: E731
    assert nf4_engine._call(bigger) == threads
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


def test_retained_kv_is_reused_and_exports_exactly(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    conv = [{"role": "user", "content": "Name a fruit."}]
    first = nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s1", retain=True)
    reply = first.result()
    resident = nf4_engine.resident_kv()
    assert (
        "s1" in resident and resident["s1"][0] == first.num_prompt_tokens + len(first.token_ids) - 1
    )
    exported = nf4_engine.export_kv("s1")
    assert exported is not None and exported.k.shape[1] == len(exported.token_ids)
    conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another?"}]
    second = nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s1", retain=True)
    second.result()
    assert second.num_cached_tokens >= first.num_prompt_tokens  # only the new turn was prefilled
    # export -> drop -> import round trip is byte-exact
    kv = nf4_engine.export_kv("s1")
    assert nf4_engine.drop_kv("s1") and "s1" not in nf4_engine.resident_kv()
    assert nf4_engine.import_kv("s1", kv)
    again = nf4_engine.export_kv("s1")
    assert again.token_ids == kv.token_ids
    assert torch.equal(again.k.view(torch.int16), kv.k.view(torch.int16))
    assert torch.equal(again.v.view(torch.int16), kv.v.view(torch.int16))
    nf4_engine.drop_kv("s1")


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


def test_extreme_sampling_values_do_not_crash_the_batch(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    p = ask(formatter, "Hi")
    bystander = nf4_engine.submit(p, GREEDY)
    odd = [
        nf4_engine.submit(p, SamplingParams(temperature=1e-30, max_new_tokens=4)),
        nf4_engine.submit(p, SamplingParams(seed=2**80, max_new_tokens=4)),
        nf4_engine.submit(p, SamplingParams(seed=-5, max_new_tokens=4)),
    ]
    for h in [bystander, *odd]:
        h.result()
        assert h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
