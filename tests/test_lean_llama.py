"""The flat Llama forward computes bitwise what transformers' Llama code computes in the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.kernels import cpu_kernels
from engine.model.lean_llama import LeanLlama, lean_forward
from engine.model.loader import LoadedModel, load_model
from engine.model.plan import StepPlan
from engine.sequence import SamplingParams, Sequence
from engine.threads import run_in_fresh_thread
from tests.conftest import make_engine


def _both_ways(loaded: LoadedModel, tmp: Path, seed: int, vocab: int = 20000) -> int:
    """Random steps (fresh prefills, prefill chunks over a cached prefix, decode groups of
    different context lengths) run through both forwards; their logits must be equal bitwise.
    Returns the steps compared."""
    engine = make_engine(loaded, tmp, kv_budget_mb=128)
    engine.shutdown()  # drive the runner on this thread
    runner, pool = engine.runner, engine.pool
    assert isinstance(runner.lean, LeanLlama)
    # the default nf4 mode on built kernels takes `_cpu_attention` (RoPE and the K/V write in
    # C++) for prefills and mixed steps too
    own = loaded.quant == "nf4" and loaded.model.dtype == torch.float32 and cpu_kernels.load()
    assert runner.lean.cpu_glue == own
    # steps with prompt tokens of up to 48 rows whose chunks take the prefill kernel: one
    # `prompt_stack` call on the int8-activation kernels (`LeanLlama._prompt_stack`)
    assert runner.lean.prompt_stacks == (own and cpu_kernels.q8_activations())
    stacked = []
    direct = runner.lean._prompt_stack
    runner.lean._prompt_stack = lambda *a: stacked.append(1) or direct(*a)
    rng = random.Random(seed)
    seqs: list[Sequence] = []
    for _ in range(rng.randint(3, 6)):
        n = rng.choice([1, 5, 17, 40, 130])
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        s = Sequence(ids, SamplingParams(max_new_tokens=8))
        s.block_table = pool.allocate(pool.blocks_for(n + 12))
        seqs.append(s)

    def step(plan: StepPlan) -> None:
        lean = runner.lean
        with torch.inference_mode():
            fast = runner.forward(plan)
            runner.lean = None
            try:
                slow = runner.forward(plan)  # writes the same K/V into the same slots
            finally:
                runner.lean = lean
        assert fast.shape == slow.shape and fast.dtype == slow.dtype
        assert torch.equal(fast, slow), (fast - slow).abs().max()

    steps = 0
    # the first chunk of each prompt, then the rest along with decodes of those that finished
    plan = StepPlan(prefills=[(s, rng.randint(1, s.num_tokens)) for s in seqs])
    for _ in range(7):
        step(plan)
        steps += 1
        for s in plan.decodes:
            s.num_computed += 1
        for s, n in plan.prefills:
            s.num_computed += n
        for s in seqs:
            if s.num_computed == s.num_tokens:  # its next token was sampled
                s.token_ids.append(rng.randrange(100, vocab))
        decodes = [s for s in seqs if s.num_computed == s.num_tokens - 1]
        rest = [(s, s.num_tokens - s.num_computed) for s in seqs if s not in decodes]
        plan = StepPlan(decodes=decodes, prefills=rest)
    # and a few steps made to fit it: short prompts, and decodes beside a short chunk
    fresh = []
    for n in (1, 9, 30):
        s = Sequence([rng.randrange(100, vocab) for _ in range(n + 12)], SamplingParams())
        s.block_table = pool.allocate(pool.blocks_for(n + 12))
        fresh.append((s, n))
    step(StepPlan(prefills=fresh))
    for s, n in fresh:
        s.num_computed = n
    step(StepPlan(decodes=[s for s, _ in fresh[:2]], prefills=[(fresh[2][0], 12)]))
    steps += 2
    if runner.lean.prompt_stacks:
        assert len(stacked) >= 2, stacked
    for s in seqs + [s for s, _ in fresh]:
        pool.free(s.block_table)
    return steps


@pytest.mark.parametrize("seed", [0, 1])
def test_lean_forward_equals_transformers_bitwise_nf4(
    nf4_model: LoadedModel, tmp_path: Path, seed: int
) -> None:
    assert run_in_fresh_thread(lambda: _both_ways(nf4_model, tmp_path, seed)) == 9


def test_lean_forward_equals_transformers_bitwise_fp32(fp32_model: LoadedModel, tmp_path) -> None:
    assert run_in_fresh_thread(lambda: _both_ways(fp32_model, tmp_path, 2)) == 9


def test_scaled_rope_is_computed_as_transformers_does(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """Llama 3's RoPE scaling: cos/sin come from the model's own rotary module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters=rope,
    )  # fmt: skip
    directory = tmp_path / "tiny-llama3"
    LlamaForCausalLM(config).save_pretrained(directory)
    nf4_model.tokenizer.save_pretrained(directory)
    model_config = EngineConfig(
        model=str(directory), data_dir=tmp_path, quant="none", dtype="float32"
    )
    loaded = load_model(model_config)
    assert loaded.model.model.rotary_emb.rope_type == "llama3"
    assert run_in_fresh_thread(lambda: _both_ways(loaded, tmp_path, 3, vocab=1000)) == 9


def test_other_decoders_keep_transformers_code(nf4_model: LoadedModel) -> None:
    model = nf4_model.model
    assert lean_forward(model) is not None
    cfg = model.config
    for attr, value in (("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")):
        old = getattr(cfg, attr, None)
        setattr(cfg, attr, value)
        try:
            assert lean_forward(model) is None, attr
        finally:
            setattr(cfg, attr, old)


@pytest.fixture(scope="module")
def nf4_fp32_model(nf4_model: LoadedModel, model_dir: Path) -> LoadedModel:
    """The embedded model in nf4 with float32 compute: its 4-bit weights on crowdchat's kernel."""
    if nf4_model.model.dtype == torch.float32:
        return nf4_model
    return load_model(EngineConfig(data_dir=model_dir, dtype="float32"))


def _decodes_both_ways(loaded: LoadedModel, tmp: Path, seed: int) -> int:
    """Steps of 1-10, 17 and 20 decode rows (the lean forward's path on crowdchat's CPU kernels:
    the 4-bit kernel up to 4 rows (16 where bf16 is native), the dense copies above: float16 on
    FBGEMM, or bfloat16) at random context lengths, run through
    both forwards (the lean one also on one thread, as few-row steps run): their logits and the
    K/V they write must be equal bitwise. Returns the forwards that took the kernels' path."""
    engine = make_engine(loaded, tmp, kv_budget_mb=128)
    engine.shutdown()  # drive the runner on this thread
    runner, pool, cache = engine.runner, engine.pool, engine.runner.cache
    lean = runner.lean
    assert isinstance(lean, LeanLlama) and lean.q4_rows >= 4
    # the int8-activation kernels (AVX512-VNNI, AVX2) split a few-row step's columns
    assert lean.shared_decodes == cpu_kernels.q8_activations()
    all_threads = torch.get_num_threads()
    assert all_threads > 1, "the suite runs where torch has more than one thread"
    taken = []
    direct = lean._decodes
    lean._decodes = lambda *a: taken.append(1) or direct(*a)
    rng = random.Random(seed)
    seqs = []
    with torch.inference_mode():
        for _ in range(20):
            n = rng.randint(1, 300)
            s = Sequence([rng.randrange(100, 20000) for _ in range(n)], SamplingParams())
            s.block_table = pool.allocate(pool.blocks_for(n + 40))
            runner.forward(StepPlan(prefills=[(s, n)]))
            s.num_computed = n
            s.token_ids.append(rng.randrange(100, 20000))
            seqs.append(s)
        for rows in [*rng.sample(range(1, 11), 10), 17, 20]:
            plan = StepPlan(decodes=rng.sample(seqs, rows))
            bs = cache.block_size
            at = [s.num_computed for s in plan.decodes]
            slots = torch.tensor(
                [
                    s.block_table[p // bs] * bs + p % bs
                    for s, p in zip(plan.decodes, at, strict=True)
                ]
            )
            written = []
            # the lean forward on all threads (each matmul's columns split over them up to 8
            # rows a thread, `decode_stack_shared`; and with the rows split at every count),
            # on one (a few-row step's, SERIAL_ROWS), then transformers' loop
            ways = ((lean, all_threads, True), (lean, all_threads, False), (lean, 1, True))
            for forward_with, threads, shared in (*ways, (None, all_threads, True)):
                for kv in (*cache.k, *cache.v):
                    kv[:, slots] = float("nan")
                runner.lean = forward_with
                torch.ops.crowdchat.omp_threads(threads)
                before = torch.ops.crowdchat.set_shared_decode(shared)
                try:
                    logits = runner.forward(plan)
                finally:
                    runner.lean = lean
                    torch.ops.crowdchat.omp_threads(all_threads)
                    torch.ops.crowdchat.set_shared_decode(before)
                written.append((logits, [kv[:, slots].clone() for kv in (*cache.k, *cache.v)]))
            (fast, fast_kv), *others = written
            for slow, slow_kv in others:
                assert torch.equal(fast, slow), (fast - slow).abs().max()
                assert all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv, strict=True))
            for s in plan.decodes:
                s.num_computed += 1
                s.token_ids.append(rng.randrange(100, 20000))
    for s in seqs:
        pool.free(s.block_table)
    return len(taken)


@pytest.mark.parametrize("seed", [0, 1])
def test_decodes_on_the_cpu_kernels_equal_transformers_bitwise(
    nf4_fp32_model: LoadedModel, tmp_path: Path, seed: int
) -> None:
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels cannot be built here")
    steps = run_in_fresh_thread(lambda: _decodes_both_ways(nf4_fp32_model, tmp_path, seed))
    assert steps == 3 * 12  # every plan on the kernels' path, both splits and on one thread


def test_a_failing_phase_of_a_shared_decode_step_raises_and_frees_the_threads(
    nf4_fp32_model: LoadedModel, tmp_path: Path
) -> None:
    """An error inside `decode_stack_shared`'s parallel region (here: a KV pool the attention
    refuses, met by the thread that has the row while the other waits at the next barrier)
    comes back as the op's error; no thread is left waiting, and the next step runs."""
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels cannot be built here")

    def run() -> None:
        engine = make_engine(nf4_fp32_model, tmp_path, kv_budget_mb=64)
        engine.shutdown()
        lean = engine.runner.lean
        assert isinstance(lean, LeanLlama) and lean.stack_weights
        assert torch.get_num_threads() > 1
        ops = torch.ops.crowdchat
        c = nf4_fp32_model.model.config
        d = c.hidden_size // c.num_attention_heads
        h = torch.randn(1, c.hidden_size)
        cos, sin = torch.ones(1, d), torch.zeros(1, d)
        good = [torch.zeros(c.num_key_value_heads, 64, d) for _ in lean.layers]
        bad = [torch.zeros(c.num_key_value_heads, 64, d, dtype=torch.float64)] * len(good)
        args = (torch.tensor([3]), torch.tensor([[0, 1]]), torch.tensor([4]), 16, 0.125)
        sizes = (c.num_attention_heads, c.num_key_value_heads)

        def step(pool: list[torch.Tensor]) -> torch.Tensor:
            weights = lean.stack_weights
            return ops.decode_stack(h, weights, lean.eps, cos, sin, pool, pool, *args, *sizes)

        with torch.inference_mode():
            assert ops.set_shared_decode(True)
            with pytest.raises(RuntimeError, match="KV pool dtype"):
                step(bad)
            out = step(good)
            assert out.shape == h.shape and bool(out.isfinite().all())

    run_in_fresh_thread(run)
