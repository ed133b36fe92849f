"""Conversation branches: regenerate and edit keep what they replace, switching changes the
active path (what the model, the API and the page see), and old databases migrate."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlite_utils import Database

from engine import SamplingParams
from engine.model.loader import LoadedModel
from sessions import migrations as migrations_module
from sessions.errors import SessionBusy
from sessions.migrations import MIGRATIONS
from sessions.prompt import conversation
from sessions.store import Store
from tests.conftest import close_sessions, make_sessions

FORCED = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
Q1, Q2 = "Name a large animal.", "Where does it live?"


def contents(rows: list[dict]) -> list[str]:
    return [m["content"] for m in rows]


def test_a_new_sibling_is_selected_and_switching_keeps_every_deeper_choice(
    tmp_path: Path,
) -> None:
    with Store(tmp_path / "c.db") as store:
        store.create_session("s", "alice", "t", "")
        u1 = store.add_message("s", "user", "q1")
        a1 = store.add_message("s", "assistant", "a1")
        a2 = store.add_message("s", "assistant", "a2", parent_id=u1)  # a regenerate
        assert contents(store.messages("s")) == ["q1", "a2"]
        store.add_message("s", "user", "q2 after a2")  # continues the active path
        path = store.messages("s")
        assert contents(path) == ["q1", "a2", "q2 after a2"]
        assert [(m["branch"], m["branches"]) for m in path] == [(1, 1), (2, 2), (1, 1)]
        assert store.select_message("s", a1)
        assert contents(store.messages("s")) == ["q1", "a1"]
        store.add_message("s", "user", "q2 after a1")
        assert store.select_message("s", a2)  # back: a2's own continuation is still there
        assert contents(store.messages("s")) == ["q1", "a2", "q2 after a2"]
        assert store.select_message("s", a1)
        assert contents(store.messages("s")) == ["q1", "a1", "q2 after a1"]
        store.add_message("s", "user", "first message, edited", parent_id=None)
        assert contents(store.messages("s")) == ["first message, edited"]
        assert len(store.message_tree("s")) == 6  # nothing was ever deleted
        store.create_session("other", "bob", "t", "")
        assert not store.select_message("other", a1)  # another session's message: refused
        assert contents(store.messages("s")) == ["first message, edited"]


def test_an_old_database_migrates_every_message_to_branch_1_of_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.db"
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:5])  # before branches
    with Store(path) as old:
        for sid in ("s", "t"):
            old.create_session(sid, "alice", "t", "")
    db = Database(path)
    for i in range(4):  # two conversations written interleaved, as a server does
        for sid in ("s", "t"):
            row = {"session_id": sid, "role": ("user", "assistant")[i % 2], "created": 0.0}
            db["messages"].insert({**row, "content": f"{sid}{i}", "token_count": 1})
    assert "parent_id" not in db["messages"].columns_dict
    db.close()
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(path) as store:
        for sid in ("s", "t"):
            path_rows = store.messages(sid)
            assert contents(path_rows) == [f"{sid}{i}" for i in range(4)]
            assert [m["parent_id"] for m in path_rows] == [None] + [m["id"] for m in path_rows[:-1]]
            assert all(m["branch"] == 1 and m["branches"] == 1 for m in path_rows)
        store.add_message("s", "user", "s4")  # and the conversation goes on where it was
        assert contents(store.messages("s"))[-2:] == ["s3", "s4"]


def test_regenerate_keeps_the_old_reply_and_the_next_turn_follows_the_branch_shown(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path)
    bs = engine.config.block_size
    try:
        sid = sm.create_session("u")["id"]
        first = sm.chat("u", sid, Q1, FORCED)
        first.result()
        again = sm.regenerate("u", sid, SamplingParams(temperature=1.0, seed=7, max_new_tokens=8))
        again.result()
        path = sm.messages("u", sid)
        assert contents(path) == [Q1, again.text]
        assert (path[1]["branch"], path[1]["branches"]) == (2, 2)
        # the regenerate computed only the reply's own tokens: the question was resident
        assert again.handle.num_cached_tokens >= len(again.prompt) - bs
        back = sm.switch_branch("u", sid, path[1]["id"], -1)
        assert contents(sm.messages("u", sid)) == [Q1, first.text]
        assert sm.switch_branch("u", sid, back, -1) == back  # clamped at the first branch
        follow = sm.chat("u", sid, Q2, FORCED)
        follow.result()
        said = sm.formatter.tokenizer.decode(follow.prompt)
        assert first.text.strip() in said and again.text.strip() not in said
        assert contents(sm.messages("u", sid)) == [Q1, first.text, Q2, follow.text]
        # the first reply's blocks were still cached: only the new message was computed
        upto_reply = len(first.prompt) + len(first.handle.token_ids) - 1
        assert follow.handle.num_cached_tokens >= upto_reply // bs * bs
        assert len(sm.store.message_tree(sid)) == 5  # nothing a user wrote was deleted
    finally:
        close_sessions(engine, sm)


def test_an_edit_is_a_sibling_of_the_original_which_comes_back_with_its_replies(
    nf4_sessions: tuple,
) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    a1 = sm.chat("u", sid, Q1, FORCED)
    a1.result()
    a2 = sm.chat("u", sid, Q2, FORCED)
    a2.result()
    edit = sm.edit_last("u", sid, "Does it swim?", FORCED)
    edit.result()
    path = sm.messages("u", sid)
    assert contents(path) == [Q1, a1.text, "Does it swim?", edit.text]
    assert (path[2]["branch"], path[2]["branches"]) == (2, 2)
    with pytest.raises(Exception, match="edited"):
        sm.edit("u", sid, path[1]["id"], "not mine", FORCED)  # a reply is not the user's
    sm.switch_branch("u", sid, path[2]["id"], -1)
    assert contents(sm.messages("u", sid)) == [Q1, a1.text, Q2, a2.text]
    first = sm.messages("u", sid)[0]
    root_edit = sm.edit("u", sid, first["id"], "Name a small animal.", FORCED)
    root_edit.result()
    assert contents(sm.messages("u", sid)) == ["Name a small animal.", root_edit.text]
    sm.switch_branch("u", sid, sm.messages("u", sid)[0]["id"], -1)
    assert contents(sm.messages("u", sid)) == [Q1, a1.text, Q2, a2.text]
    assert len(sm.store.message_tree(sid)) == 8


def test_an_earlier_reply_regenerates_as_a_sibling_and_its_old_branch_keeps_what_followed(
    nf4_sessions: tuple,
) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    a1 = sm.chat("u", sid, Q1, FORCED)
    a1.result()
    a2 = sm.chat("u", sid, Q2, FORCED)
    a2.result()
    first_reply = sm.messages("u", sid)[1]
    with pytest.raises(Exception, match="redone"):
        sm.regenerate("u", sid, FORCED, message_id=sm.messages("u", sid)[0]["id"])  # a question
    again = sm.regenerate("u", sid, SamplingParams(temperature=1.0, seed=5, max_new_tokens=8),
                          message_id=first_reply["id"])  # fmt: skip
    again.result()
    said = sm.formatter.tokenizer.decode(again.prompt)
    assert Q1 in said and Q2 not in said  # answered as the first question, nothing after it
    path = sm.messages("u", sid)
    assert contents(path) == [Q1, again.text]
    assert (path[1]["branch"], path[1]["branches"]) == (2, 2)
    sm.switch_branch("u", sid, path[1]["id"], -1)  # the old reply comes back with its follow-up
    assert contents(sm.messages("u", sid)) == [Q1, a1.text, Q2, a2.text]
    assert len(sm.store.message_tree(sid)) == 5


def test_switching_waits_for_the_reply_and_checks_the_owner(nf4_sessions: tuple) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    sm.chat("u", sid, Q1, FORCED).result()
    turn = sm.regenerate("u", sid, FORCED)
    reply = sm.messages("u", sid)[1]["id"]
    with pytest.raises(SessionBusy):
        sm.switch_branch("u", sid, reply, -1)
    turn.result()
    with pytest.raises(Exception, match="no such conversation"):
        sm.switch_branch("mallory", sid, reply, -1)
    with pytest.raises(Exception, match="no such message"):
        sm.switch_branch("u", sid, 10**9, -1)
    assert sm.switch_branch("u", sid, reply, +1) != reply


def test_fp32_a_branch_continues_exactly_as_a_cold_recompute_of_its_tokens(
    fp32_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(fp32_model, tmp_path)
    try:
        sid = sm.create_session("u")["id"]
        sm.chat("u", sid, Q1, FORCED).result()
        sm.regenerate("u", sid, SamplingParams(temperature=1.0, seed=3, max_new_tokens=8)).result()
        sm.switch_branch("u", sid, sm.messages("u", sid)[1]["id"], -1)
        warm = sm.chat("u", sid, Q2, FORCED)
        warm.result()
        assert warm.handle.num_cached_tokens > 0
        cold_sid = sm.create_session("v")["id"]  # another owner: nothing of it is cached
        for m in sm.messages("u", sid)[:-1]:
            sm.store.add_message(cold_sid, m["role"], m["content"])
        session = sm.get_session("v", cold_sid)
        convo = conversation(session, sm.store.messages(cold_sid))
        assert sm.prompts.encode_fitting(convo, FORCED) == warm.prompt
        cold = engine.submit(warm.prompt, FORCED, owner="cold")
        cold.result()
        assert cold.num_cached_tokens == 0
        assert cold.token_ids == warm.handle.token_ids
    finally:
        close_sessions(engine, sm)


def test_each_message_shows_its_own_version_and_a_reply_how_it_streamed() -> None:
    from ui.message_meta import ReplyStats, StatsMemory, meta_of

    path = [
        {"id": 1, "role": "user", "content": "Hi there", "branch": 2, "branches": 2},
        {"id": 4, "role": "assistant", "content": "Hello!", "branch": 1, "branches": 3,
         "token_count": 3},
        {"id": 5, "role": "user", "content": "More", "branch": 1, "branches": 1},
        {"id": 6, "role": "assistant", "content": "Sure.", "branch": 1, "branches": 1,
         "token_count": 2},
    ]  # fmt: skip
    stats = StatsMemory(size=1)
    stats.put(6, ReplyStats(tokens=2, first_token_s=0.123, tokens_per_s=31.25))
    items = meta_of(path, stats)["items"]
    assert [(m["branch"], m["branches"]) for m in items] == [(2, 2), (1, 3), (1, 1), (1, 1)]
    assert [m["role"] for m in items] == ["user", "assistant", "user", "assistant"]
    assert items[0]["stats"] == "" and items[1]["stats"] == "3 tokens"  # streamed before
    assert items[3]["stats"] == "2 tokens · 31.2 tokens/s · first token in 0.12 s"
    stats.put(7, ReplyStats(tokens=1, first_token_s=0.5, tokens_per_s=None))
    assert stats.get(6) is None and stats.get(7).text() == "1 token · first token in 0.50 s"
