"""Read-only share links: a copy of the active branch as it was when shared, revocable by its
owner, never a way into another conversation or into writing the original; who may open one
is --share-links (off, signed-in, public)."""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from doors.browser_id import COOKIE
from engine import InvalidRequest
from engine.model.loader import LoadedModel
from sessions import SessionNotFound
from sessions.shares import MAX_LINKS_PER_CONVERSATION
from tests.conftest import close_sessions, make_sessions
from tests.test_doors import add_user, signed_in
from tests.web import bearer, running_server
from ui.share_dialog import ShareDialog

KEYS = "ann:key-ann-0123456789ab\nben:key-ben-0123456789ab\n"
ANN, BEN = bearer("key-ann-0123456789ab"), bearer("key-ben-0123456789ab")


@pytest.fixture(scope="module")
def sm(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    engine, manager = make_sessions(nf4_model, tmp_path_factory.mktemp("shares"))
    yield manager
    close_sessions(engine, manager)


def talk(sm, owner: str, title: str, *texts: str) -> str:  # noqa: ANN001
    sid = sm.create_session(owner, title)["id"]
    for i, text in enumerate(texts):
        sm.store.add_message(sid, ("user", "assistant")[i % 2], text)
    return sid


def test_a_link_shows_the_conversation_as_it_was_shared_until_revoked(sm) -> None:  # noqa: ANN001
    sid = talk(sm, "alice", "Figs", "Do figs ripen off the tree?", "No, pick them ripe.")
    link = sm.share("alice", sid)
    sm.store.add_message(sid, "user", "my secret afterthought")
    shared = sm.read_share(link["token"])
    assert shared["title"] == "Figs"
    assert [m["content"] for m in shared["messages"]] == [
        "Do figs ripen off the tree?",
        "No, pick them ripe.",
    ]
    assert [s["token"] for s in sm.shares("alice", sid)] == [link["token"]]
    with pytest.raises(SessionNotFound):
        sm.revoke_share("bob", link["token"])  # only its owner takes it back
    sm.revoke_share("alice", link["token"])
    with pytest.raises(SessionNotFound):
        sm.read_share(link["token"])
    with pytest.raises(SessionNotFound):
        sm.revoke_share("alice", link["token"])
    assert sm.shares("alice", sid) == []
    db = sqlite3.connect(sm.store.path)  # the revoked copy is dropped, not just hidden
    assert db.execute(
        "SELECT messages FROM shares WHERE token = ?", [link["token"]]
    ).fetchone() == (None,)


def test_a_link_never_shows_another_conversation_nor_opens_its_original(sm) -> None:  # noqa: ANN001
    mine = talk(sm, "carol", "Mine", "carol's question", "carol's answer")
    theirs = talk(sm, "dave", "Theirs", "dave's private words")
    token = sm.share("carol", mine)["token"]
    for guess in (secrets.token_urlsafe(24), token[:-1] + ("A" if token[-1] != "A" else "B"), "",
                  mine, theirs, "../" + token, token + "/.."):  # fmt: skip
        with pytest.raises(SessionNotFound):
            sm.read_share(guess)
    assert "dave" not in str(sm.read_share(token))
    with pytest.raises(SessionNotFound):
        sm.share("carol", theirs)  # nor can one share another's conversation
    with pytest.raises(SessionNotFound):
        sm.shares("carol", theirs)
    # a viewer continues it as their own copy; the original is untouched
    before = sm.store.message_tree(mine)
    copy = sm.copy_share("erin", token)
    assert copy != mine and sm.get_session("erin", copy)["title"] == "Mine"
    assert [m["content"] for m in sm.messages("erin", copy)] == [
        "carol's question",
        "carol's answer",
    ]
    sm.store.add_message(copy, "user", "erin goes on")
    assert sm.store.message_tree(mine) == before
    with pytest.raises(SessionNotFound):
        sm.messages("erin", mine)
    # deleting the conversation takes its links with it
    sm.delete_session("carol", mine)
    with pytest.raises(SessionNotFound):
        sm.read_share(token)


def test_empty_conversations_and_too_many_links_are_refused(sm) -> None:  # noqa: ANN001
    empty = sm.create_session("fay", "Nothing yet")["id"]
    with pytest.raises(InvalidRequest, match="nothing to share"):
        sm.share("fay", empty)
    sid = talk(sm, "fay", "Many", "hello")
    for _ in range(MAX_LINKS_PER_CONVERSATION):
        sm.share("fay", sid)
    with pytest.raises(InvalidRequest, match="revoke one first"):
        sm.share("fay", sid)


# -- over HTTP ----------------------------------------------------------------------------


def server(nf4_model: LoadedModel, data: Path, **overrides: object):  # noqa: ANN201
    keys = data / "keys.txt"
    data.mkdir(parents=True, exist_ok=True)
    keys.write_text(KEYS)
    return running_server(nf4_model, data / "srv", api_keys_file=keys, **overrides)


def shared_by_ann(http: httpx.Client) -> tuple[str, str]:
    sid = http.post("/v1/sessions", json={"title": "Plums <b>"}, headers=ANN).json()["id"]
    chat = {"messages": [{"role": "user", "content": "<script>alert(1)</script>"}], "max_tokens": 3}
    r = http.post("/v1/chat/completions", json=chat, headers={**ANN, "X-Session-Id": sid})
    assert r.status_code == 200
    made = http.post(f"/v1/sessions/{sid}/shares", headers=ANN)
    assert made.status_code == 200, made.text
    return sid, made.json()["id"]


def test_over_http_a_viewer_reads_continues_and_cannot_write_the_original(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    with (
        server(nf4_model, tmp_path) as (url, _engine, sm),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        sid, token = shared_by_ann(http)
        listed = http.get(f"/v1/sessions/{sid}/shares", headers=ANN).json()["data"]
        assert [s["id"] for s in listed] == [token] and listed[0]["path"] == f"/share/{token}"
        assert http.get(f"/v1/sessions/{sid}/shares", headers=BEN).status_code == 404
        with httpx.Client(base_url=url, timeout=60) as viewer:
            page = viewer.get(f"/share/{token}")
            assert page.status_code == 200 and "read-only" in page.text
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text  # escaped, never run
            assert "<script>alert" not in page.text and "Plums &lt;b&gt;" in page.text
            assert viewer.get(f"/share/{token}?format=json").json()["title"] == "Plums <b>"
            # continuing it: only from this server's own page (a form elsewhere gets 403)
            forged = viewer.post(f"/share/{token}/copy", headers={"Origin": "https://evil.test"})
            assert forged.status_code == 403
            copied = viewer.post(f"/share/{token}/copy", headers={"Origin": url})
            assert copied.status_code == 303 and copied.headers["location"] == "../.."
            owner = "browser:" + _browser(viewer, sm)
            (copy,) = [s["id"] for s in sm.list_sessions(owner)]
            assert copy != sid
        ann_tree = sm.store.message_tree(sid)
        assert len(ann_tree) == 2  # the viewer wrote nothing into the original
        # revoked: gone for everyone, API and page alike
        assert http.delete(f"/v1/shares/{token}", headers=BEN).status_code == 404
        assert http.delete(f"/v1/shares/{token}", headers=ANN).json()["deleted"] is True
        assert http.get(f"/share/{token}").status_code == 404
        assert http.post(f"/share/{token}/copy", headers={"Origin": url}).status_code == 404


def _browser(client: httpx.Client, sm) -> str:  # noqa: ANN001
    from doors.browser_id import BrowserIds

    key = (Path(sm.store.path).parent / "cookie.key").read_text().strip()
    return BrowserIds(key, per_minute=10).verify(client.cookies[COOKIE])


def test_share_links_off_makes_and_shows_none(nf4_model: LoadedModel, tmp_path: Path) -> None:
    with (
        server(nf4_model, tmp_path, share_links="off") as (url, _engine, sm),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        sid = http.post("/v1/sessions", json={}, headers=ANN).json()["id"]
        sm.store.add_message(sid, "user", "hello")
        refused = http.post(f"/v1/sessions/{sid}/shares", headers=ANN)
        assert refused.status_code == 400 and "--share-links" in refused.text
        # issue 57, defect 10: every door that makes links (the page's hidden section too)
        # asks the manager, which refuses
        owner = sm.store.get_session(sid)["owner"]
        page = SimpleNamespace(sm=sm, owner=lambda _request: owner)
        menu = SimpleNamespace(_data={"id": sid})  # the conversation menu's Share event
        *_, said = ShareDialog(page).on_share(menu, None)  # type: ignore[arg-type]
        assert said.startswith("Error: share links are off")
        with pytest.raises(InvalidRequest, match="--share-links"):
            sm.share(owner, sid)
        assert sm.shares(owner, sid) == []
        row = sm.store.get_session(sid)  # one made behind its back still reads as nothing
        token = sm.store.shares.create(owner, row, sm.store.messages(sid))["token"]
        assert http.get(f"/share/{token}").status_code == 404


@pytest.mark.parametrize("mode", ["signed-in", "public"])
def test_with_sign_in_a_link_reads_without_it_only_when_public(
    nf4_model: LoadedModel, tmp_path: Path, mode: str
) -> None:
    users = tmp_path / "users.txt"
    add_user(users, "ann")
    add_user(users, "ben")
    with running_server(
        nf4_model, tmp_path / "srv", auth_file=users, admin_password=None, share_links=mode
    ) as (url, _engine, sm):
        sid = talk(sm, "user:ann", "Pears", "are pears apples?")
        token = sm.share("user:ann", sid)["token"]
        stranger = httpx.get(f"{url}/share/{token}")
        if mode == "public":
            assert stranger.status_code == 200 and "are pears apples?" in stranger.text
            assert 'id="continue"' not in stranger.text  # continuing needs a sign-in
            copy = httpx.post(f"{url}/share/{token}/copy", headers={"Origin": url})
            assert copy.status_code == 401
        else:
            assert stranger.status_code == 401
        with signed_in(url, "ben") as ben:
            page = ben.get(f"/share/{token}")
            assert page.status_code == 200 and 'id="continue"' in page.text
            assert ben.post(f"/share/{token}/copy", headers={"Origin": url}).status_code == 303
        assert [s["title"] for s in sm.list_sessions("user:ben")] == ["Pears"]
