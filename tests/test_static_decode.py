"""The CUDA path's decode step on persistent buffers (engine/model/static_decode.py), run on the CPU
with the Triton kernel in its interpreter (tests/conftest.py) over a tiny float32 Llama: the same
replies as the dynamic step, padded rows that touch only the scratch block, and the pool never
handing that block out. Capture and replay as CUDA graphs: tests/test_cuda.py."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.chat_format import ChatFormatter
from engine.kernels import cpu_kernels, triton_attention
from engine.model.loader import LoadedModel, decode_buckets, graph_buckets, load_model
from engine.model.plan import StepPlan
from engine.model.runner import ModelRunner
from engine.model.static_decode import MIN_SPLIT_TOKENS, StaticDecode, split_tokens
from engine.sequence import Sequence
from tests.model_zoo import build
from tests.rig import make_engine
from tests.step_logits import fused_layer_steps, prefilled

pytestmark = [
    pytest.mark.skipif(not triton_attention.available(), reason="triton not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/test_cuda.py runs it"),
]


@pytest.fixture(scope="module")
def tiny(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random float32 Llama with the CUDA path's hooks: Triton attention, buckets 1-4."""
    directory = build("llama", tmp_path_factory.mktemp("tiny") / "llama", nf4_model.tokenizer)
    config = EngineConfig(model=str(directory), data_dir=directory, quant="none", dtype="float32")
    return replace(load_model(config), cuda_attention="triton", decode_buckets=(1, 2, 4))


def three_prompts(seed: int) -> list[Sequence]:
    """Three sequences of 5, 17 and 40 random tokens (blocks of their own once prefilled)."""
    rng = random.Random(seed)
    return [
        Sequence([rng.randrange(100, 2000) for _ in range(n)], SamplingParams())
        for n in (5, 17, 40)
    ]


def engine_for(loaded: LoadedModel, tmp: Path, **overrides: object) -> Engine:
    return make_engine(loaded, tmp, quant="none", dtype="float32", model="tiny", **overrides)


def test_the_buckets_follow_the_setting() -> None:
    assert graph_buckets(0) == ()
    assert graph_buckets(1) == (1,)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    with pytest.raises(Exception, match="cuda-graph-rows"):
        EngineConfig(cuda_graph_rows=-1)
    # what a load gets: up to --max-num-seqs, capped by --cuda-graph-rows; only where the
    # Triton kernel attends; never for bitsandbytes int8 (not capturable: eager)
    assert decode_buckets(EngineConfig(max_num_seqs=24), "triton") == (1, 2, 4, 8, 16, 24)
    assert decode_buckets(EngineConfig(cuda_graph_rows=4), "triton") == (1, 2, 4)
    assert decode_buckets(EngineConfig(cuda_graph_rows=0), "triton") == ()
    assert decode_buckets(EngineConfig(), "gather") == ()
    assert decode_buckets(EngineConfig(quant="int8"), "triton") == ()
    assert decode_buckets(EngineConfig(quant="nf4"), "triton")[-1] == 64


def test_static_steps_reply_as_dynamic_ones_token_for_token(tiny: LoadedModel, tmp_path: Path):
    """Three conversations decoding together (bucket 4: one padded row), then fewer as they
    end: the same greedy replies as the dynamic step's, and the static step really ran."""
    fmt = ChatFormatter(tiny.tokenizer)
    prompts = [fmt.encode([{"role": "user", "content": q}]) for q in ("Hi!", "Why?", "How so?")]
    replies = []
    for loaded in (tiny, replace(tiny, decode_buckets=())):
        engine = engine_for(loaded, tmp_path)
        runner = engine.runner  # type: ignore[attr-defined]
        static = runner.static
        assert (static is not None) == bool(loaded.decode_buckets)
        runs = []
        if static is not None:
            direct = static.run
            static.run = lambda decodes, direct=direct, runs=runs: (
                runs.append(len(decodes)) or direct(decodes)
            )
        try:
            handles = [
                engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=4 + 3 * i))
                for i, ids in enumerate(prompts)
            ]
            for h in handles:
                h.result()
            replies.append([h.token_ids for h in handles])
        finally:
            engine.check_integrity()
            engine.shutdown()
        if static is not None:
            assert 3 in runs and 1 in runs, runs  # padded to 4, and alone
    assert replies[0] == replies[1]
    assert [len(r) for r in replies[0]] == [4, 7, 10]


def test_padded_rows_write_only_the_scratch_block(tiny: LoadedModel, tmp_path: Path) -> None:
    """A static step of 3 decodes (bucket 4): the K/V of its own 3 tokens and the scratch
    block change, nothing else in the pool; its logits are the dynamic step's."""
    engine = engine_for(tiny, tmp_path)
    engine.shutdown()  # drive the runner on this thread
    runner, pool, cache = engine.runner, engine.pool, engine.cache  # type: ignore[attr-defined]
    static: StaticDecode = runner.static
    assert cache.scratch_block == pool.num_blocks  # one block past what the pool hands out
    seqs = three_prompts(3)
    with torch.inference_mode():
        prefilled(engine, seqs)
        assert cache.scratch_block not in {b for s in seqs for b in s.block_table}
        bs = cache.block_size
        own = [s.block_table[s.num_computed // bs] * bs + s.num_computed % bs for s in seqs]
        scratch = range(cache.scratch_block * bs, (cache.scratch_block + 1) * bs)
        before = cache.data.clone()
        got = static.run(seqs).clone()
        changed = (cache.data != before).flatten(0, 2).any(-1).any(0).nonzero().flatten()
        assert set(changed.tolist()) <= set(own) | set(scratch)
        assert set(own) <= set(changed.tolist())
        assert cache.data[:, :, :, list(scratch)].abs().sum() > 0  # the padded row wrote there
        cache.data.copy_(before)
        runner.static = None
        want = runner.forward(StepPlan(decodes=seqs))
        runner.static = static
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_failed_capture_leaves_every_step_eager(
    tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Capture that fails (here the CPU, which has no CUDA graphs; on a GPU a kernel that
    cannot be captured) is said in the log and the engine serves on, every step eager."""
    fmt = ChatFormatter(tiny.tokenizer)
    ids = fmt.encode([{"role": "user", "content": "Hi!"}])
    params = SamplingParams(temperature=0, max_new_tokens=6)
    engine = engine_for(tiny, tmp_path)
    try:
        want = engine.generate([ids], params)
    finally:
        engine.shutdown()
    engine = engine_for(tiny, tmp_path)
    runner = engine.runner  # type: ignore[attr-defined]
    assert runner.static is not None
    with caplog.at_level("WARNING", logger="engine.model.runner"):
        runner._capture()  # the engine thread is idle: nothing steps meanwhile
    try:
        assert runner.static is None and runner.graph_bytes == 0
        assert any("every step runs eager" in r.getMessage() for r in caplog.records)
        stats = engine.stats()  # and said where figures are read: no silent fallback
        assert stats.cuda_graphs == 0 and stats.cuda_graph_error
        assert engine.generate([ids], params) == want
    finally:
        engine.check_integrity()
        engine.shutdown()


def test_rope_and_the_kv_write_fused_give_the_same_step_bitwise(
    nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Half-precision compute (float16 here; bfloat16 on a GPU) takes RoPE with the K/V write
    in one kernel for steps of decodes, static and dynamic: the same logits and the same pool,
    bitwise, as the tensor ops and `index_copy_` they replace; its residual adds and norms in
    one kernel each, within rounding of the tensor ops."""
    directory = build("llama", tmp_path_factory.mktemp("half") / "llama", nf4_model.tokenizer)
    config = EngineConfig(model=str(directory), data_dir=directory, quant="none", dtype="float16")
    half = replace(
        load_model(config), cuda_attention="triton", decode_buckets=(1, 2, 4), triton_layers=True
    )
    engine = make_engine(half, tmp_path, quant="none", dtype="float16", model="tiny")
    engine.shutdown()  # drive the runner on this thread
    runner, cache = engine.runner, engine.cache  # type: ignore[attr-defined]
    static: StaticDecode = runner.static
    assert runner.rope_store is not None and static.rope_store is not None
    calls = []
    fused_op = runner.rope_store
    counted = lambda *a: calls.append(1) or fused_op(*a)  # noqa: E731
    seqs = three_prompts(5)
    with torch.inference_mode():
        prefilled(engine, seqs)
        before = cache.data[:, :, :, : cache.scratch_block * cache.block_size].clone()
        results, tensor_norms = fused_layer_steps(engine, seqs, counted)
    # the norms' kernel (each residual add with its norm) against torch.rms_norm: within
    # rounding, not bitwise (its sums of squares run in Triton's order)
    assert runner.lean.norm_kernel is not None
    torch.testing.assert_close(tensor_norms, results[0][0], rtol=0.02, atol=0.02)
    layers = len(cache.k)
    assert len(calls) == 2 * layers  # a call a layer, in the static and the dynamic step
    for logits, pool in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(pool, results[0][1])
    assert not torch.equal(results[0][1], before)  # the step wrote its K/V


def test_the_static_tables_are_as_wide_as_max_model_len_not_the_models_positions(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The static step's block table has the columns of --max-model-len's blocks (the model
    takes 1,024 positions: 64 columns of 16), and each bucket its own split: a row alone
    spreads its context over more programs than a full bucket does."""
    wide = engine_for(tiny, tmp_path)
    narrow = engine_for(tiny, tmp_path, max_model_len=100)
    try:
        assert narrow.max_model_len == 100 and wide.max_model_len == 1024
        static = narrow.runner.static  # type: ignore[attr-defined]
        assert static.width == 7  # ceil(100 / 16)
        assert static.table.shape == (4, 7)
        assert wide.runner.static.width == 64  # type: ignore[attr-defined]
        splits = wide.runner.static.split_tokens  # type: ignore[attr-defined]
        assert splits[1] <= splits[4] and all(t % 16 == 0 for t in splits.values())
        # a reply still decodes in the narrow tables, up to the length cap
        fmt = ChatFormatter(tiny.tokenizer)
        ids = fmt.encode([{"role": "user", "content": "Hi!"}])
        params = SamplingParams(temperature=0, max_new_tokens=200)
        (got,) = narrow.generate([ids], params)
        assert len(ids) + len(got) == 100
    finally:
        narrow.shutdown()
        wide.shutdown()


def test_the_split_size_follows_the_bucket_and_the_width() -> None:
    """One row of 8 KV heads over 8,192 tokens: 64 splits of 128; 32 rows: 4 of 2,048; a
    narrow table: splits of no fewer than MIN_SPLIT_TOKENS; always whole blocks."""
    assert split_tokens(8192, 1, 8, 16) == 128
    assert split_tokens(8192, 32, 8, 16) == 2048
    assert split_tokens(100, 64, 3, 16) == MIN_SPLIT_TOKENS  # not 6 splits of 17 tokens
    assert split_tokens(8192, 2, 3, 16) == MIN_SPLIT_TOKENS * 2  # 64 splits, capped
    assert split_tokens(1000, 1, 1, 48) % 48 == 0


def test_no_cpu_kernel_probe_where_they_do_not_attend(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Triton attends (the CUDA path), the runner asks nothing of crowdchat's CPU
    kernels' build: on a GPU machine that probe built them (-march=native, ~1 minute)."""
    probed: list[str] = []
    monkeypatch.setattr(cpu_kernels, "q4_dot_layout", lambda: probed.append("q4") or False)
    engine = engine_for(tiny, tmp_path)
    engine.shutdown()
    assert engine.runner.static is not None  # type: ignore[attr-defined]
    assert probed == []


class PendingCopy:
    """A test event: after `record` it reports its copy as still running until waited on."""

    def __init__(self, name: int, log: list[tuple[str, int]]) -> None:
        self.name, self.log, self.done = name, log, True

    def record(self) -> None:
        self.log.append(("record", self.name))
        self.done = False

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))
        self.done = True

    def query(self) -> bool:
        return self.done


def test_the_staging_buffers_alternate_and_a_pending_copys_buffer_is_left_alone(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """Step N+1 is prepared while step N's copy may still be reading its host buffer (the
    loop runs a step ahead on CUDA): the static decode fills the other one, waiting first on
    that one's event only, so N's staged rows stay as they were until the copy is done."""
    engine = engine_for(tiny, tmp_path)
    engine.shutdown()  # drive the runner on this thread
    static: StaticDecode = engine.runner.static  # type: ignore[attr-defined]
    log: list[tuple[str, int]] = []
    static.copied = [PendingCopy(0, log), PendingCopy(1, log)]
    seqs = three_prompts(5)
    with torch.inference_mode():
        prefilled(engine, seqs)
        static.run(seqs)
        assert log == [("wait", 0), ("record", 0)]
        first = static.hosts[0].clone()
        assert torch.equal(static.flat, first)  # the device took buffer 0
        seqs[1].num_computed += 1  # another step's rows: a later position for one of them
        seqs[1].token_ids.append(7)
        static.run(seqs[:2])
        # buffer 1, after waiting on its own event; buffer 0's copy still pending, untouched
        assert log[2:] == [("wait", 1), ("record", 1)]
        assert not static.copied[0].query()
        assert torch.equal(static.hosts[0], first)
        assert not torch.equal(static.hosts[1], first)
        assert torch.equal(
            static.flat[: static.max_rows * 5], static.hosts[1][: static.max_rows * 5]
        )
        static.run(seqs[:1])
        assert log[4:] == [("wait", 0), ("record", 0)]  # back to buffer 0, once its copy is done


def test_running_ahead_the_static_steps_reply_as_step_by_step(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The CUDA loop on the CPU: each step launched before the last one's tokens are read, its
    decodes fed them on the device (`StaticDecode.run`'s `fed`). Greedy, seeded sampled and
    penalized replies (penalties read the ids on the host: those steps wait), with a request
    arriving mid-way (its prefill waits too), are the step-by-step loop's token for token."""
    fmt = ChatFormatter(tiny.tokenizer)
    prompts = [fmt.encode([{"role": "user", "content": q}]) for q in ("Hi!", "Why?", "How so?")]
    params = [
        SamplingParams(temperature=0, max_new_tokens=9),
        SamplingParams(temperature=0.8, seed=5, max_new_tokens=12),
        SamplingParams(temperature=0, max_new_tokens=6, repetition_penalty=1.3),
    ]
    replies, fed = [], []

    def ahead(*args: object) -> ModelRunner:
        runner = ModelRunner(*args)  # type: ignore[arg-type]
        runner.runs_ahead = True  # as on CUDA
        direct = runner.static.run
        runner.static.run = lambda decodes, fed_by=None: (
            fed.append(fed_by is not None) or direct(decodes, fed_by)
        )
        return runner

    for factory in (ModelRunner, ahead):
        engine = engine_for(tiny, tmp_path, runner=factory)
        try:
            first = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2], strict=True)]
            first[0]._done.wait(0.05)  # the third arrives while the first two decode
            handles = [*first, engine.submit(prompts[2], params[2])]
            replies.append([(h.result(), h.token_ids, h.finish_reason) for h in handles])
        finally:
            engine.check_integrity()
            engine.shutdown()
    assert replies[0] == replies[1]
    assert True in fed and False in fed  # steps fed on the device, and steps that waited
