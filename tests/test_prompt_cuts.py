"""A prompt token's K/V and logits do not depend on how the scheduler cut its prompt into
chunks, nor on what else shared the step: on the CPU's int8-activation kernels (the default)
every chunk attends on the kernel, whose queries are bitwise the decode's, so a conversation
computed fresh, after a cached prefix, after a restore or beside other users' decodes leaves
the same bytes. Two users sent the same message get the same greedy reply
(tests/test_crash.py's victim and twin, the twin's prompt after the shared system prompt)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from engine import SamplingParams
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.sequence import Sequence
from tests.conftest import close_sessions, make_engine, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def test_a_prompts_kv_and_logits_do_not_depend_on_its_chunks_or_the_steps_other_rows(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """One prompt of 300-700 tokens computed three ways: the scheduler's own cut (512 tokens
    a step from nothing), after the 16 tokens of a shared system prompt in chunks of 65-256
    beside 0-12 decodes, and after a random cached prefix the same way (a returning user's
    message): every K/V byte and the last token's logits bitwise equal."""
    engine = make_engine(nf4_model, tmp_path, kv_budget_mb=192)
    engine.shutdown()  # drive the runner on this thread
    runner, pool, rng = engine.runner, engine.pool, random.Random(59)
    others = []
    for _ in range(12):  # other users' decodes, each at its own context
        s = Sequence([rng.randrange(100, 20000) for _ in range(rng.randint(20, 400))], GREEDY)
        s.block_table = pool.allocate(pool.blocks_for(s.num_tokens + 8))
        runner.forward(StepPlan(prefills=[(s, s.num_tokens)]))
        s.num_computed = s.num_tokens
        others.append(s)

    def computed(toks: list[int], cuts: list[int], decodes: bool) -> tuple[torch.Tensor, ...]:
        """The prompt's K, V and last logits, prefilled in chunks of `cuts` tokens."""
        s = Sequence(list(toks), GREEDY)
        s.block_table = pool.allocate(pool.blocks_for(len(toks)))
        try:
            logits = None
            for n in cuts:
                rows = rng.sample(others, rng.randint(0, 12)) if decodes else []
                for d in rows:  # a decode's next token (its slot rewritten each step)
                    d.token_ids.append(rng.randrange(100, 20000))
                logits = runner.forward(StepPlan(decodes=rows, prefills=[(s, n)]))
                for d in rows:
                    d.token_ids.pop()
                s.num_computed += n
            assert logits is not None
            k, v = engine.cache.export(s.block_table, len(toks))
            return k, v, logits[-1]
        finally:
            pool.free(s.block_table)

    def chunks(total: int) -> list[int]:
        out: list[int] = []
        while sum(out) < total:
            out.append(min(rng.randint(65, 256), total - sum(out)))
        return out

    try:
        for _ in range(2):
            toks = [rng.randrange(100, 20000) for _ in range(rng.randint(300, 700))]
            n = len(toks)
            whole = computed(toks, [min(512, n), n - 512] if n > 512 else [n], decodes=False)
            cached = rng.randint(32, n - 65)
            for cut in ([16, *chunks(n - 16)], [cached, *chunks(n - cached)]):
                other = computed(toks, cut, decodes=True)
                for a, b in zip(whole, other, strict=True):
                    assert torch.equal(a, b), cut
    finally:
        for s in others:
            pool.free(s.block_table)
    engine.check_integrity()


def test_two_users_sent_the_same_message_get_the_same_replies_and_kv(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """Two conversations open with the same message, the second after the first's: its
    prompt comes after the shared system prompt's cached blocks, the first's from nothing
    (271 tokens against 16 + 255 for the longest). Both turns' greedy replies are the same,
    and so is every byte of their K/V."""
    for repeats in (12, 40):  # prompts of ~90 and 271 tokens
        first = "Tell me about the sea. " * repeats
        engine, sm = make_sessions(nf4_model, tmp_path / str(repeats))  # nothing cached yet
        try:
            replies, kvs = [], []
            for user in ("victim", "twin"):
                sid = sm.create_session(user)["id"]
                a = sm.chat(user, sid, first, GREEDY).result()
                b = sm.chat(user, sid, "Still there?", GREEDY).result()
                replies.append((a, b))
                kvs.append(engine.export_kv(sid))
        finally:
            close_sessions(engine, sm)
        assert replies[0] == replies[1], repeats
        victim, twin = kvs
        assert victim.token_ids == twin.token_ids
        assert torch.equal(victim.k, twin.k) and torch.equal(victim.v, twin.v), repeats
