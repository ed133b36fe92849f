"""Usage a user can see: tokens this minute against --tokens-per-minute, replies in flight and
conversations against their caps, over the API and on the chat page."""

from __future__ import annotations

import httpx
import pytest

from engine import SamplingParams
from engine.model.loader import LoadedModel
from sessions import RateLimited
from tests.conftest import close_sessions, make_sessions
from tests.web import bearer, running_server
from ui.chat_page import ChatPage
from ui.settings_dialog import SettingsDialog
from ui.status_line import near_limit, usage_text


def test_the_usage_line_says_where_a_user_stands_and_when_tokens_free() -> None:
    u = {
        "tokens_used": 900, "tokens_reserved": 200, "tokens_per_minute": 1000,
        "tokens_free_in_seconds": 41.6, "turns_answering": 1, "max_turns_per_user": 4,
        "requests_in_flight": 1, "max_requests_per_user": 128, "conversations": 3,
        "max_sessions_per_user": 200,
    }  # fmt: skip
    assert usage_text(u) == (
        "Your usage: 1,100 of 1,000 tokens this minute (some free in 42 s) · 1 of 4 replies "
        "at once · 3 of 200 conversations"
    )
    off = {**u, "tokens_per_minute": 0, "max_turns_per_user": 0, "max_sessions_per_user": 0}
    assert usage_text(off) == ""
    # under the composer only near a limit (the settings dialog shows it always)
    assert near_limit(u) and not near_limit(off)
    calm = {**u, "tokens_used": 100, "tokens_reserved": 0}
    assert not near_limit(calm) and near_limit({**calm, "conversations": 190})


def test_a_limited_user_sees_the_tokens_that_limit_them(nf4_model: LoadedModel, tmp_path) -> None:  # noqa: ANN001
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=60)
    try:
        sid = sm.create_session("amy")["id"]
        sm.chat("amy", sid, "Hi", SamplingParams(temperature=0, max_new_tokens=8)).result()
        u = sm.usage("amy")
        assert u["tokens_used"] > 8 and u["tokens_reserved"] == 0
        assert 0 < u["tokens_free_in_seconds"] <= 60 and u["conversations"] == 1
        assert sm.usage("bea")["tokens_used"] == 0  # another user's window is their own
        with pytest.raises(RateLimited):
            sm.chat("amy", sid, "Again", SamplingParams(temperature=0, max_new_tokens=60))
        page = ChatPage(sm, auth_enabled=True)

        class Req:  # what the page reads of a signed-in user's request
            username, headers, cookies, request = "amy", {}, {}, None

        sm.create_session("user:amy")
        shown, near = SettingsDialog(page).on_usage(Req())
        assert shown.endswith("1 of 200 conversations") and near == ""  # far from any limit
    finally:
        close_sessions(engine, sm)


def test_get_usage_over_the_api_is_the_callers_own(nf4_model: LoadedModel, tmp_path) -> None:  # noqa: ANN001
    keys = tmp_path / "keys.txt"
    keys.write_text("ann:key-ann-0123456789ab\nben:key-ben-0123456789ab\n")
    ann, ben = bearer("key-ann-0123456789ab"), bearer("key-ben-0123456789ab")
    with running_server(nf4_model, tmp_path / "srv", api_keys_file=keys) as (url, _e, _sm):
        with httpx.Client(base_url=url, timeout=60) as http:
            before = http.get("/v1/usage", headers=ann).json()
            assert before["object"] == "usage" and before["tokens_used"] == 0
            assert before["tokens_per_minute"] == 20_000 and before["max_turns_per_user"] == 4
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            assert http.post("/v1/chat/completions", json=chat, headers=ann).status_code == 200
            after = http.get("/v1/usage", headers=ann).json()
            assert after["tokens_used"] >= 4 and after["requests_in_flight"] == 0
            assert http.get("/v1/usage", headers=ben).json()["tokens_used"] == 0
