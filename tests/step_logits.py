"""One engine step's logits, run by hand on an engine's runner, for the tests that compare a
batch with its members run alone (tests/test_batching.py, test_paged_attention.py, test_cuda.py);
and the questions they ask."""

from __future__ import annotations

import torch

from engine.model.plan import StepPlan
from engine.sequence import Sequence

QUESTIONS = [
    "Hi",
    "What is 2+2?",
    "Write a haiku about the sea and the moon and the stars above the mountains.",
    "Explain photosynthesis in detail, step by step, for a ten year old who loves plants.",
    "Name three colors.",
    "Why is the sky blue? Please answer carefully and mention Rayleigh scattering.",
    "Tell me a joke about cats.",
    "List the planets of the solar system in order from the sun, with one fact about each of "
    "them, and say which one you would most like to visit and why.",
]


def first_step_logits(engine, seqs: list[Sequence]) -> torch.Tensor:
    """Prefill `seqs` together in one step and return their last-position logits."""
    plan = StepPlan(prefills=[(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens))
    try:
        return engine.runner.forward(plan).float()
    finally:
        for s in seqs:
            engine.pool.free(s.block_table)


def prefilled(engine, seqs: list[Sequence]) -> None:
    """Prefill each of `seqs` alone into blocks of its own (room for one more token), then
    give it that token: each is ready for a decode step."""
    for s in seqs:
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens + 1))
        engine.runner.forward(StepPlan(prefills=[(s, s.num_tokens)]))
        s.num_computed = s.num_tokens
        s.token_ids.append(28)


def decode_logits(engine, seqs: list[Sequence]) -> torch.Tensor:
    """Prefill each alone, then run one batched decode step of all of them."""
    prefilled(engine, seqs)
    try:
        return engine.runner.forward(StepPlan(decodes=seqs)).float()
    finally:
        for s in seqs:
            engine.pool.free(s.block_table)


def fused_layer_steps(engine, seqs: list[Sequence], rope_store) -> tuple[list, torch.Tensor]:  # noqa: ANN001
    """A decode step of `seqs` (prefilled) static then dynamic, each with RoPE and the K/V
    write fused (`rope_store`) and without: their (logits, pool but the scratch block) in that
    order, each from the same pool; then the static step's logits without the norm kernel.
    The static step runs eagerly (a captured graph holds whatever path it was captured on)."""
    runner, cache = engine.runner, engine.cache
    static = runner.static
    before = cache.data.clone()
    scratch = cache.scratch_block * cache.block_size  # the padded rows write past it

    def static_step() -> torch.Tensor:
        static._fill(seqs)
        return static._forward(static.bucket(len(seqs)))[: len(seqs)].clone()

    results = []
    for step in ("static", "dynamic"):
        for fused in (rope_store, None):
            cache.data.copy_(before)
            runner.rope_store = static.rope_store = fused
            if step == "static":
                logits = static_step()
            else:
                runner.static = None
                logits = runner.forward(StepPlan(decodes=seqs)).clone()
                runner.static = static
            results.append((logits, cache.data[:, :, :, :scratch].clone()))
    norm_kernel, runner.lean.norm_kernel = runner.lean.norm_kernel, None
    cache.data.copy_(before)
    tensor_norms = static_step()
    runner.lean.norm_kernel = norm_kernel
    runner.rope_store = static.rope_store = rope_store
    return results, tensor_norms
