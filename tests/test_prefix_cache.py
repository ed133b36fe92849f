"""The prefix cache: shared system prompts across users, isolation of everything users wrote,
eviction order, and exactness on the real model (fp32 token for token)."""

from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from engine.chat_format import ChatFormatter
from engine.model.loader import LoadedModel
from sessions.reply import kv_source
from tests.conftest import close_sessions, make_engine, make_sessions
from tests.fake_model import expected_reply, fake_engine
from ui.admin_page import prefix_hit_rate

SYSTEM = list(range(100, 164))  # 64 tokens: 4 blocks of 16
MESSAGE = list(range(200, 240))  # 40 tokens: 2 full blocks and 8
GREEDY4 = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


def test_the_shared_system_prompt_is_shared_across_users_and_their_messages_never_are() -> None:
    engine, _ = fake_engine(64)
    try:
        prompt = SYSTEM + MESSAGE

        def send(sid: str, user: str, shared: int = len(SYSTEM), ids: list[int] = prompt):
            h = engine.submit(
                ids, GREEDY4, owner=sid, retain=True, cache_ns=user, shareable_prefix=shared
            )
            h.result()
            assert h.token_ids == expected_reply(ids, 4, engine.max_model_len, True)
            return h

        assert send("a1", "alice").num_cached_tokens == 0  # the first one computes it all
        bob = send("b1", "bob")  # alice's exact message: only the system prompt hits
        assert bob.num_hit_tokens == bob.num_cached_tokens == len(SYSTEM)
        assert engine.stats().blocks_shared == 4  # both sessions hold the 4 system blocks
        again = send("a2", "alice")  # alice in a new conversation: her message's full blocks
        assert again.num_hit_tokens == len(SYSTEM) + 32
        mallory = send("m1", "mallory", shared=0)  # not an operator-shared prompt: no hit
        assert mallory.num_cached_tokens == 0
        engine.check_integrity()
        stats = engine.stats()
        assert stats.prefix_cache_hits == 64 + 96
        assert stats.prefix_cache_queries == 4 * len(prompt)
        assert prefix_hit_rate(stats) == f"{100 * 160 / (4 * len(prompt)):.1f}%"  # admin page
    finally:
        engine.shutdown()


def test_cached_blocks_nobody_holds_go_before_any_session_kv() -> None:
    engine, _ = fake_engine(8)
    calls: list[int] = []
    engine.set_memory_pressure_hook(lambda short, protected: calls.append(short))
    try:
        engine.submit(list(range(3, 30)), GREEDY4, owner="s", retain=True).result()  # 2 blocks
        one_off = list(range(300, 370))  # 70 tokens: 4 full blocks stay cached after it
        engine.submit(one_off, SamplingParams(max_new_tokens=1), cache_ns="u").result()
        stats = engine.stats()
        assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (2, 4, 6)
        big = engine.submit(list(range(400, 490)), SamplingParams(max_new_tokens=1))  # 6 blocks
        big.result()
        assert calls == [] and "s" in engine.resident_kv()  # the cache made room, not "s"
        assert engine.stats().blocks_cached == 0
        engine.submit(list(range(500, 600)), SamplingParams(max_new_tokens=1)).result()
        assert calls == [1]  # 7 blocks: now the session layer is asked
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_prompt_fully_cached_still_computes_its_last_token() -> None:
    engine, runner = fake_engine(16)
    try:
        prompt = list(range(3, 35))  # exactly 2 blocks
        first = engine.submit(prompt, GREEDY4, cache_ns="u")
        first.result()
        again = engine.submit(prompt, GREEDY4, cache_ns="u")
        again.result()
        assert again.num_hit_tokens == 16  # the second block holds the last token: recomputed
        assert again.token_ids == first.token_ids
        engine.check_integrity()
    finally:
        engine.shutdown()


# -- the real model, fp32: sharing changes nothing --------------------------------------
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
SYSTEM_TEXT = (
    "You are the assistant of the Riverside team. Answer briefly, kindly and precisely. "
    "The team builds bridges, tunnels and harbours, and its people like short answers. " * 3
)


def convo(formatter: ChatFormatter, text: str) -> tuple[list[int], int]:
    """A conversation's ids and its shareable prefix (template head + system prompt)."""
    ids = formatter.encode(
        [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": text}]
    )
    head = formatter.encode(
        [{"role": "system", "content": SYSTEM_TEXT}], add_generation_prompt=False
    )
    assert ids[: len(head)] == head
    return ids, len(head)


def test_fp32_a_reply_on_shared_blocks_equals_a_cold_recompute_and_restores_load_the_rest(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    formatter = ChatFormatter(fp32_model.tokenizer)
    engine = make_engine(fp32_model, tmp_path)
    bs = engine.config.block_size
    try:
        alice, shared = convo(formatter, "Which is longer, a bridge or a tunnel?")
        first = engine.submit(
            alice, GREEDY, owner="a", retain=True, cache_ns="alice", shareable_prefix=shared
        )
        first.result()
        full_kv = engine.export_kv("a")
        assert engine.drop_kv("a")
        bob, _ = convo(formatter, "Name one harbour, please.")
        cold = engine.submit(bob, GREEDY)  # nothing cached for it: computed from scratch
        cold.result()
        assert cold.num_cached_tokens == 0
        warm = engine.submit(
            bob, GREEDY, owner="b", retain=True, cache_ns="bob", shareable_prefix=shared
        )
        warm.result()
        assert warm.num_hit_tokens == shared // bs * bs > 0
        assert warm.token_ids == cold.token_ids
        # alice's session comes back while her full blocks are still cached (the system ones
        # held by bob): only the rest loads
        assert engine.import_kv("a", full_kv, cache_ns="alice", shareable_prefix=shared)
        from_cache = engine.scheduler.resident.num_loaded_from_cache
        assert shared // bs * bs <= from_cache < len(full_kv.token_ids)
        partial = engine.export_kv("a")
        assert partial.token_ids == full_kv.token_ids
        assert (partial.k - full_kv.k).abs().max() < 1e-4
        assert (partial.v - full_kv.v).abs().max() < 1e-4
        follow = (
            alice
            + first.token_ids
            + formatter.encode([{"role": "user", "content": "And a harbour?"}])[:8]
        )
        on_partial = engine.submit(follow, GREEDY, owner="a", retain=True, cache_ns="alice")
        on_partial.result()
        assert on_partial.num_cached_tokens == len(full_kv.token_ids)
        assert engine.drop_kv("a") and engine.drop_kv("b")
        # a prompt as large as the pool evicts every cached block: the restore loads it all
        filler = list(range(1000, 1000 + engine.max_model_len - 2))
        engine.submit(filler, SamplingParams(max_new_tokens=1)).result()
        before = engine.scheduler.resident.num_loaded_from_cache
        assert engine.import_kv("a", full_kv, cache_ns="alice", shareable_prefix=shared)
        assert engine.scheduler.resident.num_loaded_from_cache == before
        on_full = engine.submit(follow, GREEDY, owner="a", retain=True)
        on_full.result()
        assert on_full.token_ids == on_partial.token_ids
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_sessions_share_the_operators_system_prompt_and_nothing_users_wrote(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    system_file = tmp_path / "system.txt"
    system_file.write_text(SYSTEM_TEXT)
    engine, sm = make_sessions(fp32_model, tmp_path / "data", shared_system_prompt=system_file)
    bs = engine.config.block_size
    question = "Which is longer, a bridge or a tunnel? Answer in one sentence, please."
    try:
        first = sm.chat("alice", sm.create_session("alice")["id"], question, GREEDY)
        first.result()
        shared = sm.prompts.shareable(first.prompt)
        assert shared > bs and first.num_hit_tokens == 0
        bob = sm.chat("bob", sm.create_session("bob")["id"], question, GREEDY)
        bob.result()  # alice's exact first message: only the system prompt's blocks hit
        assert bob.num_hit_tokens == shared // bs * bs and kv_source(bob) == "cached"
        assert bob.text == first.text
        again = sm.chat("alice", sm.create_session("alice")["id"], question, GREEDY)
        again.result()  # alice herself, in a new conversation: her message hits too
        assert again.num_hit_tokens > shared // bs * bs and again.text == first.text
        own = sm.create_session("bob", system_prompt="You answer in French.")
        mine = sm.chat("bob", own["id"], question, GREEDY)
        mine.result()  # a user's own system prompt is never shared
        assert mine.num_hit_tokens == 0 and kv_source(mine) == "cold"
    finally:
        close_sessions(engine, sm)
