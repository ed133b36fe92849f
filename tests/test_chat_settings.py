"""Per-conversation sampling settings: kept in SQLite with the conversation, shown when it opens,
new conversations start from the user's last choice; over the API, a session's settings fill
what a request leaves out."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import httpx
import pytest
from sqlite_utils import Database

from doors.browser_id import COOKIE
from engine import InvalidRequest
from engine.model.loader import LoadedModel
from sessions.chat_settings import ChatSettings
from sessions.migrations import MIGRATIONS, migrate
from sessions.store import Store
from tests.conftest import close_sessions, make_sessions
from tests.web import bearer, running_server
from ui.chat_page import ChatPage, Screen
from ui.settings_dialog import SettingsDialog

COOL = ChatSettings(temperature=0.2, top_p=0.5, max_tokens=48, repetition_penalty=1.3)
WARM = ChatSettings(temperature=1.4, top_p=1.0, max_tokens=256, repetition_penalty=1.0)


def slider_values(s: ChatSettings) -> tuple:
    return (s.temperature, s.top_p, s.max_tokens, s.repetition_penalty)


def test_settings_out_of_range_or_of_the_wrong_kind_are_refused_with_the_field_named() -> None:
    for bad, field in (
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 12.5}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"repetition_penalty": 3}, "repetition_penalty"),
        ({"seed": 1}, "unknown setting 'seed'"),
    ):
        with pytest.raises(InvalidRequest, match=field):
            ChatSettings.from_dict(bad)
    with pytest.raises(InvalidRequest, match="object"):
        ChatSettings.from_dict([1])
    assert ChatSettings(max_tokens=64.0).max_tokens == 64  # a slider's float
    assert ChatSettings.from_dict({"top_p": 0.5}, COOL) == ChatSettings(0.2, 0.5, 48, 1.3)
    assert ChatSettings.from_json('{"temperature": 99}') == ChatSettings()  # a bad row: defaults
    assert ChatSettings.from_json(None) is None


@pytest.fixture
def page(nf4_model: LoadedModel, tmp_path: Path) -> Iterator[ChatPage]:
    engine, sm = make_sessions(nf4_model, tmp_path)
    yield ChatPage(sm)
    close_sessions(engine, sm)


def browser(page: ChatPage) -> gr.Request:
    _browser_id, value = page.browser_ids.mint("test")  # type: ignore[misc]
    return gr.Request(cookies={COOKIE: value})


def shown(section: SettingsDialog, sid: str | None, me: gr.Request) -> tuple:
    """The sliders' values once the tab has opened `sid` (None: a new chat)."""
    screen = Screen()
    screen.sid = sid
    return section.on_show(sid, screen, me)


def send(page: ChatPage, me: gr.Request, sid: str | None, s: ChatSettings) -> str:
    *_, last = page.on_send("Hi there", sid, None, "", *slider_values(s), Screen(), me)
    assert not last[1].startswith("Error"), last[1]
    return last[2]


def test_each_conversation_keeps_its_own_settings_and_new_ones_start_from_the_last(
    page: ChatPage, tmp_path: Path
) -> None:
    section, me, other = SettingsDialog(page), browser(page), browser(page)
    assert shown(section, None, me) == slider_values(ChatSettings())  # before any choice
    cool = send(page, me, None, COOL)
    warm = send(page, me, None, WARM)
    assert shown(section, cool, me) == slider_values(COOL)
    assert shown(section, warm, me) == slider_values(WARM)
    assert shown(section, None, me) == slider_values(WARM)  # a new chat: the last choice
    assert shown(section, None, other) == slider_values(ChatSettings())  # not another's
    # moving a slider keeps it with the open conversation at once
    assert section.on_change(cool, 0.9, 0.5, 48, 1.3, me) == ""
    assert shown(section, cool, me)[0] == 0.9 and shown(section, warm, me)[0] == 1.4
    assert shown(section, None, me)[0] == 0.9
    assert section.on_change(cool, 7, 0.5, 48, 1.3, me).startswith("Error: temperature")
    assert shown(section, cool, me)[0] == 0.9  # the bad value was not kept
    # a late answer for a conversation the tab has left paints nothing
    elsewhere = Screen()
    elsewhere.sid = warm
    assert section.on_show(cool, elsewhere, me) == (gr.skip(),) * 4
    # another browser cannot read or write them
    owner = page.owner(me)
    assert section.on_change(cool, 0.1, 0.5, 48, 1.3, other).startswith("Error")
    assert page.sm.settings(owner, cool).temperature == 0.9
    # kept in SQLite: a new store on the same file reads them back
    path = page.sm.store.path
    with Store(path) as again:
        assert ChatSettings.from_json(again.get_session(cool)["settings"]).temperature == 0.9
        assert ChatSettings.from_json(again.owner_settings(owner)).temperature == 0.9


def test_a_send_with_settings_out_of_range_stores_nothing_and_says_why(page: ChatPage) -> None:
    me = browser(page)
    out = list(page.on_send("Hi", None, None, "", 5.0, 0.9, 64, 1.0, Screen(), me))
    assert out[-1][1].startswith("Error: temperature") and out[-1][2] is None
    assert page.sm.list_sessions(page.owner(me)) == []


def test_a_database_from_before_settings_reads_its_conversations_with_the_last_choice(
    tmp_path: Path,
) -> None:
    path = tmp_path / "crowdchat.db"
    db = Database(path)
    before = MIGRATIONS[: MIGRATIONS.index(next(m for m in MIGRATIONS if "settings" in m.__name__))]
    for fn in before:
        fn(db)
    db["sessions"].insert({"id": "s", "owner": "alice", "title": "Old", "created": 0,
                           "last_active": 0, "state": "cold"})  # fmt: skip
    db["_migrations"].insert_all([{"name": m.__name__, "applied": 0} for m in before], pk="name")
    assert migrate(db)[0] == "m009_settings"
    db.close()
    with Store(path) as store:
        assert store.get_session("s")["settings"] is None
        assert store.owner_settings("alice") is None


@pytest.fixture(scope="module")
def server(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("ann:key-ann-0123456789ab\nben:key-ben-0123456789ab\n")
    with running_server(
        nf4_model, tmp_path_factory.mktemp("settings-http"), api_keys_file=keys
    ) as (url, _engine, sm):
        yield url, sm


def test_over_the_api_a_sessions_settings_fill_what_a_request_leaves_out(server) -> None:  # noqa: ANN001
    url, _sm = server
    ann, ben = bearer("key-ann-0123456789ab"), bearer("key-ben-0123456789ab")
    greedy3 = {"temperature": 0, "max_tokens": 3, "top_p": 1, "repetition_penalty": 1}
    hi = {"messages": [{"role": "user", "content": "Count to twenty."}]}
    with httpx.Client(base_url=url, timeout=60) as http:
        plain = http.post("/v1/sessions", json={}, headers=ann).json()["id"]
        assert http.get(f"/v1/sessions/{plain}", headers=ann).json()["settings"] is None
        sid = http.post("/v1/sessions", json={"settings": greedy3}, headers=ann).json()["id"]
        got = http.get(f"/v1/sessions/{sid}", headers=ann).json()
        assert got["settings"] == {**greedy3, "temperature": 0.0, "top_p": 1.0,
                                   "repetition_penalty": 1.0}  # fmt: skip
        r = http.post("/v1/chat/completions", json=hi, headers={**ann, "X-Session-Id": sid})
        assert r.json()["usage"]["completion_tokens"] == 3  # the session's max_tokens
        # what the request names wins over the session's
        hi2 = {"messages": [{"role": "user", "content": "Again."}], "max_tokens": 5}
        r = http.post("/v1/chat/completions", json=hi2, headers={**ann, "X-Session-Id": sid})
        assert r.json()["usage"]["completion_tokens"] == 5
        # PATCH changes some of them; bad ones are a 400 naming the field, and change nothing
        r = http.patch(f"/v1/sessions/{sid}", json={"settings": {"max_tokens": 2}}, headers=ann)
        assert r.status_code == 200
        assert http.get(f"/v1/sessions/{sid}", headers=ann).json()["settings"]["max_tokens"] == 2
        bad = http.patch(f"/v1/sessions/{sid}", json={"settings": {"top_p": 7}}, headers=ann)
        assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]
        bad = http.post("/v1/sessions", json={"settings": "hot"}, headers=ann)
        assert bad.status_code == 400 and "settings" in bad.json()["error"]["message"]
        assert http.get(f"/v1/sessions/{sid}", headers=ann).json()["settings"]["top_p"] == 1.0
        # another user: 404 for reading, changing, deleting
        assert http.get(f"/v1/sessions/{sid}", headers=ben).status_code == 404
        patch = http.patch(f"/v1/sessions/{sid}", json={"title": "mine"}, headers=ben)
        assert patch.status_code == 404
        assert http.delete(f"/v1/sessions/{sid}", headers=ben).status_code == 404
        assert http.delete(f"/v1/sessions/{sid}", headers=ann).json()["deleted"] is True
        assert http.get(f"/v1/sessions/{sid}", headers=ann).status_code == 404
