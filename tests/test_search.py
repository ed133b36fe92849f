"""Search over one's own conversations: titles and messages of every branch in SQLite FTS5,
kept current by triggers, over the session manager, the API and the chat page."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlite_utils import Database

from api.openai_api import build_router
from engine import InvalidRequest
from engine.model.loader import LoadedModel
from sessions.migrations import MIGRATIONS, migrate
from sessions.search import MAX_QUERY_CHARS, fts_query
from sessions.store import Store
from tests.conftest import close_sessions, make_sessions
from tests.web import bearer
from ui.conversation_list import MARKS, ConversationList

WORDS = "apple banana cherry damson elder fig grape hazel".split()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "crowdchat.db") as s:
        yield s


def chat(store: Store, sid: str, owner: str, title: str, *texts: str) -> list[int]:
    store.create_session(sid, owner, title, "")
    return [
        store.add_message(sid, "user" if i % 2 == 0 else "assistant", t)
        for i, t in enumerate(texts)
    ]


def test_a_user_finds_titles_and_messages_of_their_own_conversations_only(store: Store) -> None:
    chat(store, "a1", "alice", "Fruit notes", "tell me about plums", "plums are stone fruit")
    chat(store, "a2", "alice", "Trip", "where is Lisbon?", "Lisbon is in Portugal")
    chat(store, "b1", "bob", "Plums for Bob", "bob likes plums and Lisbon")
    hits = store.search("alice", "plums", 20, ("[", "]"))
    assert [h["session_id"] for h in hits] == ["a1"]
    assert hits[0]["role"] in ("user", "assistant") and "[plums]" in hits[0]["snippet"]
    title = store.search("alice", "fru", 20, ("[", "]"))  # the last word is a prefix
    assert title[0]["message_id"] is None and title[0]["snippet"] == "[Fruit] notes"
    assert [h["session_id"] for h in store.search("bob", "lisbon", 20, ("", ""))] == ["b1"]
    assert store.search("carol", "plums", 20, ("", "")) == []


def test_seeded_crowds_never_see_each_others_words_and_miss_none_of_their_own(
    store: Store,
) -> None:
    rng = random.Random(7)
    owners = [f"user{i}" for i in range(5)]
    have: dict[tuple[str, str], set[str]] = {}  # (owner, word) -> sessions holding it
    for n in range(60):
        owner, sid = rng.choice(owners), f"s{n}"
        texts = [" ".join(rng.sample(WORDS, 2)) for _ in range(rng.randint(1, 4))]
        title = rng.choice(WORDS) if rng.random() < 0.3 else ""
        chat(store, sid, owner, title, *texts)
        for word in {*" ".join(texts).split(), *title.split()}:
            have.setdefault((owner, word), set()).add(sid)
    for owner in owners:
        for word in WORDS:
            found = {h["session_id"] for h in store.search(owner, word, 50, ("", ""))}
            assert found == have.get((owner, word), set()), (owner, word)


def test_the_index_follows_renames_edits_and_deletes(store: Store) -> None:
    (first,) = chat(store, "s", "alice", "Old name", "original wording")
    store.update_session("s", title="Quince list")
    assert store.search("alice", "quince", 5, ("", ""))[0]["message_id"] is None
    assert store.search("alice", "old name", 5, ("", "")) == []
    store.update_message(first, content="rewritten entirely")
    assert store.search("alice", "original", 5, ("", "")) == []
    assert store.search("alice", "rewritten", 5, ("", ""))[0]["message_id"] == first
    store.delete_session("s")
    assert store.search("alice", "rewritten", 5, ("", "")) == []
    assert store.search("alice", "quince", 5, ("", "")) == []


@pytest.mark.parametrize(
    "typed",
    ['"', "AND", "NOT plums", "plums OR", "NEAR(", "title:plums", "plu*", "(plums", "^plums", "'"],
)
def test_fts_syntax_typed_by_a_user_is_searched_as_words(store: Store, typed: str) -> None:
    chat(store, "s", "alice", "", "plums AND NEAR title OR NOT")
    if not any(c.isalnum() for c in typed):
        with pytest.raises(InvalidRequest, match="word"):
            store.search("alice", typed, 5, ("", ""))
        return
    hits = store.search("alice", typed, 5, ("", ""))  # never an FTS5 syntax error
    assert [h["session_id"] for h in hits] == ["s"]


def test_empty_huge_and_odd_searches_get_clear_errors() -> None:
    for bad, message in (("", "word"), ("   ", "word"), ("?!", "word"), (None, "text")):
        with pytest.raises(InvalidRequest, match=message):
            fts_query(bad)
    with pytest.raises(InvalidRequest, match=str(MAX_QUERY_CHARS)):
        fts_query("a" * (MAX_QUERY_CHARS + 1))
    assert fts_query(" ".join(["w"] * 40)).count('"w"') == 16  # at most 16 terms
    assert fts_query("crème brûlée") == '"crème" "brûlée"*'


def test_a_database_from_before_search_gets_its_old_messages_indexed(tmp_path: Path) -> None:
    path = tmp_path / "crowdchat.db"
    db = Database(path)
    for fn in MIGRATIONS[: MIGRATIONS.index(next(m for m in MIGRATIONS if "search" in m.__name__))]:
        fn(db)
    db["sessions"].insert({"id": "s", "owner": "alice", "title": "Medlar", "created": 0,
                           "last_active": 0, "state": "cold"})  # fmt: skip
    db["messages"].insert({"session_id": "s", "role": "user", "content": "about loquats",
                           "created": 0, "parent_id": None})  # fmt: skip
    db["_migrations"].insert_all(
        [{"name": m.__name__, "applied": 0} for m in MIGRATIONS if "search" not in m.__name__],
        pk="name",
    )
    assert migrate(db) == ["m008_search"]
    db.close()
    with Store(path) as store:
        assert store.search("alice", "loquats", 5, ("", ""))[0]["session_id"] == "s"
        assert store.search("alice", "medlar", 5, ("", ""))[0]["message_id"] is None
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.fixture(scope="module")
def served(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    engine, sm = make_sessions(nf4_model, tmp_path_factory.mktemp("search"))
    app = FastAPI()
    app.include_router(build_router(engine, sm, "m"))  # type: ignore[arg-type]
    with TestClient(app) as http:
        yield sm, http
    close_sessions(engine, sm)


def test_the_api_lists_and_searches_the_callers_sessions_only(served) -> None:  # noqa: ANN001
    sm, http = served
    mine = http.post("/v1/sessions", json={"title": "Persimmon plans"}, headers=bearer("k1"))
    theirs = http.post("/v1/sessions", json={"title": "Persimmon too"}, headers=bearer("k2"))
    sm.store.add_message(mine.json()["id"], "user", "ripe persimmons in November")
    listed = http.get("/v1/sessions", headers=bearer("k1")).json()["data"]
    assert mine.json()["id"] in [s["id"] for s in listed]
    assert theirs.json()["id"] not in [s["id"] for s in listed]
    found = http.get("/v1/sessions", params={"q": "persimmons"}, headers=bearer("k1")).json()
    assert [(s["id"], s["match"]["in"]) for s in found["data"]] == [(mine.json()["id"], "message")]
    assert "**persimmons**" in found["data"][0]["match"]["snippet"]
    titles = http.get("/v1/sessions", params={"q": "persimmon"}, headers=bearer("k2")).json()
    assert [s["id"] for s in titles["data"]] == [theirs.json()["id"]]
    for params, status in (
        ({"q": ""}, 400),
        ({"q": "x" * 201}, 400),
        ({"q": "a", "limit": "x"}, 400),
    ):
        r = http.get("/v1/sessions", params=params, headers=bearer("k1"))
        assert r.status_code == status and r.json()["error"]["message"], params


class Req:  # what the page's handlers read of a gr.Request for a signed-in user
    def __init__(self, user: str) -> None:
        self.username, self.headers, self.cookies, self.request = user, {}, {}, None


def test_the_page_opens_a_hit_on_another_branch_with_it_on_the_path(served) -> None:  # noqa: ANN001
    from ui.chat_page import ChatPage, Screen

    sm, _ = served
    page = ChatPage(sm, auth_enabled=True)
    owner = page.owner(Req("ann"))
    sid = sm.create_session(owner, title="Walnuts")["id"]
    ask = sm.store.add_message(sid, "user", "how do walnuts grow?")
    old = sm.store.add_message(sid, "assistant", "on tall trees, slowly", parent_id=ask)
    sm.store.add_message(sid, "assistant", "in green husks", parent_id=ask)  # now selected
    convos = ConversationList(page)

    def find(text: str, user: str) -> tuple:
        return convos.on_find(gr.EventData(None, {"text": text}), Screen(), Req(user))

    listing, status = find("slowly", "ann")
    assert status == "" and listing["query"] == "slowly"
    (hit,) = listing["hits"]  # each conversation once, with its best match
    assert (hit["id"], hit["message"], hit["where"]) == (sid, old, "reply")
    assert f"{MARKS[0]}slowly{MARKS[1]}" in hit["snippet"] and hit["title"] == "Walnuts"
    assert find("slowly", "bob")[0]["hits"] == []  # not Bob's
    assert find("", "ann")[0]["hits"] is None  # an empty box: the list again
    pick = gr.EventData(None, {"id": sid, "message": old})
    shown_sid, chatbot, status, _system, listing, *_ = convos.on_pick(pick, Screen(), Req("ann"))
    assert shown_sid == sid and status == "" and listing["open"] == sid
    assert chatbot[-1]["content"] == "on tall trees, slowly"
    assert sm.messages(owner, sid)[-1]["id"] == old  # the next turn follows it too
    assert convos.on_pick(pick, Screen(), Req("bob"))[2].startswith("Error")
