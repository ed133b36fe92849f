"""Chat page handlers without a browser: queue status, sign-in identity, the users file."""

from __future__ import annotations

import io
import itertools
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
from gradio_client import Client

from doors.browser_id import COOKIE
from engine import SamplingParams
from engine.model.loader import LoadedModel
from tests.conftest import close_sessions, make_sessions
from tests.web import running_server
from ui import auth, reply_stream
from ui.chat_page import ChatPage, Screen
from ui.status_line import turn_status


def browser(page: ChatPage) -> tuple[str, gr.Request]:
    """A new anonymous browser: its owner string and a request carrying its signed cookie."""
    browser_id, value = page.browser_ids.mint("test")  # type: ignore[misc]
    return f"browser:{browser_id}", gr.Request(cookies={COOKIE: value})


@pytest.fixture
def on_page(nf4_model: LoadedModel, tmp_path: Path) -> Iterator[tuple]:
    """A chat page over a fresh engine and session manager, and a new anonymous browser on it:
    (engine, session manager, page, the browser's owner string, its request)."""
    engine, sm = make_sessions(nf4_model, tmp_path)
    page = ChatPage(sm)
    yield (engine, sm, page, *browser(page))
    close_sessions(engine, sm)


def test_status_tells_the_user_where_they_are(nf4_model: LoadedModel, tmp_path: Path) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, {"max_num_seqs": 1})
    try:
        long = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
        first = sm.chat("a", sm.create_session("a")["id"], "Go on and on.", long)
        it = iter(first)
        next(it)
        waiting = [sm.chat(o, sm.create_session(o)["id"], "Hi", long) for o in ("b", "c")]
        for turn in waiting:  # b queues first, then c behind it
            threading.Thread(target=turn.result, daemon=True).start()
            deadline = time.time() + 10
            while turn.handle is None or engine.queue_position(turn.handle) is None:
                assert time.time() < deadline
                time.sleep(0.05)
        want = ["Waiting for a free slot…", "Waiting: 1 ahead of you…"]

        def status(t: object) -> str:
            return turn_status(t, engine)  # type: ignore[arg-type]

        def shown() -> list[str]:  # the wait estimate aside (from the admission rate)
            return [re.sub(r" \(about \d+ s\)", "", status(t)) for t in waiting]

        deadline = time.time() + 10  # the engine thread publishes positions after a step
        while shown() != want:
            assert time.time() < deadline, [status(t) for t in waiting]
            time.sleep(0.05)
        # one admission so far (the first turn): a slot frees about once per elapsed second
        assert re.fullmatch(r"Waiting: 1 ahead of you \(about \d+ s\)…", status(waiting[1]))
        assert status(first) == ""  # it streams: the reply says it all
        for t in (first, *waiting):
            t.cancel()
        list(it)
        deadline = time.time() + 10
        while any(t.status != "done" for t in waiting) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        close_sessions(engine, sm)


class Queued:
    """A turn in the queue whose position the engine reports as `ahead`."""

    status = "queued"

    def __init__(self, ahead: int | None) -> None:
        self.ahead = ahead

    def queue_position(self) -> int | None:
        return self.ahead


class Engine:
    """An engine with `running` of `max_num_seqs` slots busy; a slot frees every 2 s."""

    def __init__(self, running: int, max_num_seqs: int = 4) -> None:
        self.running, self.max_num_seqs = running, max_num_seqs

    def stats(self) -> object:
        return SimpleNamespace(running=self.running)

    def wait_estimate(self, ahead: int) -> float:
        return 2.0 * (ahead + 1)


def test_the_status_never_counts_below_zero_and_says_waiting_only_when_something_waits() -> None:
    """Issue 56: an idle server said "Waiting for a free slot (about 13 s)…" for the step
    before its reply started, and once "Waiting: -1 ahead of you"."""
    idle, full = Engine(running=0), Engine(running=4)
    assert turn_status(Queued(0), idle) == ""  # admitted at the next step: no word
    assert turn_status(Queued(-1), idle) == ""  # the engine's count, one below zero
    assert turn_status(Queued(-1), full) == "Waiting for a free slot (about 2 s)…"
    assert turn_status(Queued(2), idle) == "Waiting: 2 ahead of you (about 6 s)…"
    assert turn_status(Queued(None), full) == ""  # admitted meanwhile
    assert turn_status(SimpleNamespace(status="generating"), full) == ""
    assert turn_status(SimpleNamespace(status="restoring"), idle).startswith("Restoring")


def test_users_file_hashes_and_checks_passwords(tmp_path: Path, monkeypatch) -> None:
    users = tmp_path / "users.txt"
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret-pass\n"))
    auth.main([str(users), "ann"])
    text = users.read_text()
    assert text.startswith("ann:pbkdf2_sha256$") and "s3cret-pass" not in text
    check = auth.users_checker(users)
    assert check("ann", "s3cret-pass") and not check("ann", "wrong") and not check("bob", "x")
    admin = auth.admin_checker("pw")
    assert admin("admin", "pw") and not admin("admin", "pW") and not admin("root", "pw")
    assert not admin("ädmin", "pw") and not admin("admin", "pwé")  # non-ASCII: no TypeError
    with pytest.raises(SystemExit):
        monkeypatch.setattr(sys, "stdin", io.StringIO("short\n"))
        auth.main([str(users), "bob"])


def test_signed_in_user_sees_their_conversations_from_any_browser(
    nf4_model: LoadedModel, tmp_path: Path, monkeypatch
) -> None:
    users = tmp_path / "users.txt"
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret-pass\n"))
    auth.main([str(users), "ann"])
    with running_server(nf4_model, tmp_path / "data", auth_file=users) as (url, _, sm):
        laptop = Client(url, auth=("ann", "s3cret-pass"), verbose=False)
        laptop.predict("Remember the word banana.", "", 0.0, 1.0, 16, 1.0, api_name="/on_send")
        phone = Client(url, auth=("ann", "s3cret-pass"), verbose=False)
        history, _status, _system, listing, *_ = phone.predict(api_name="/on_load")
        assert len(listing["items"]) == 1
        assert "banana" in str(history)
        assert sm.list_sessions("user:ann")
        with pytest.raises(Exception):  # noqa: B017 - gradio_client raises its own type
            Client(url, auth=("ann", "wrong"), verbose=False)


def test_a_conversation_keeps_its_system_prompt_across_reload_switch_and_new_chat(
    on_page: tuple,
) -> None:
    engine, sm, page, owner, me = on_page

    screen = Screen()

    def send(message: str, sid: str | None, system: str) -> str:
        *_, last = page.on_send(message, sid, None, system, 0.0, 1.0, 8, 1.0, screen, me)
        return last[2]

    pirate = send("Hello there.", None, "You are a pirate.")
    # a reload: the box shows the conversation's own prompt, so the next Send keeps it
    sid, _history, _status, system, *_ = page.on_load(Screen(), me)
    assert (sid, system) == (pirate, "You are a pirate.")
    send("And again.", sid, system)
    assert sm.get_session(owner, pirate)["system_prompt"] == "You are a pirate."
    # "New chat" empties the box; the new conversation keeps its own (empty) prompt
    assert page.on_new(screen, me)[3] == ""
    plain = send("Hi.", None, "")
    assert page.on_select(pirate, screen, me)[3] == "You are a pirate."
    assert page.on_select(plain, screen, me)[3] == ""
    assert sm.get_session(owner, plain)["system_prompt"] == ""
    assert sm.get_session(owner, pirate)["system_prompt"] == "You are a pirate."
    assert page.on_delete(plain, screen, me)[3] == ""


def test_a_reply_paints_only_while_its_conversation_is_on_screen(
    on_page: tuple, monkeypatch
) -> None:
    engine, sm, page, owner, me = on_page
    # away, a reply yields every AWAY_S (2 s): three such yields outlasted a 200-token reply
    # on a fast box, and the reply ended before the user came back
    monkeypatch.setattr(reply_stream, "AWAY_S", 0.01)
    screen = Screen()
    other = sm.create_session(owner)["id"]
    sm.chat(owner, other, "Say hi.", SamplingParams(temperature=0, max_new_tokens=4)).result()
    stream = page.on_send(
        "Write a long story about a lighthouse keeper.",
        None,
        None,
        "",
        0.0,
        1.0,
        200,
        1.0,
        screen,
        me,
    )
    first = next(stream)
    sid = first[2]
    assert first[0][0]["content"].startswith("Write a long story")
    # the user opens the other conversation while the reply runs: once, the reply's stream
    # repaints that one (a delta it yielded just before may reach the browser after the
    # page showed it), then nothing paints over it
    opened = page.on_select(other, screen, me)
    assert opened[0] == other
    away = [next(stream) for _ in range(3)]
    assert away[0][0] == opened[1] and away[0][2] == other, away[0]
    assert all(out == (gr.skip(),) * 7 for out in away[1:]), away
    # back again: the reply so far, then the rest, paint again, into this conversation
    page.on_select(sid, screen, me)
    back = list(stream)
    assert back and all(out[2] == sid for out in back)
    final = back[-1][0]
    assert [m["role"] for m in final] == ["user", "assistant"] and final[1]["content"]
    stored = sm.messages(owner, sid)  # the turn ran on while away and was committed
    assert [m["content"] for m in stored] == [m["content"] for m in final]
    assert len(sm.messages(owner, other)) == 2


def sent(
    page: ChatPage,
    request: gr.Request,
    message: str,
    sid: str | None,
    editing: int | None,
    screen: Screen | None = None,
):
    """Every update of one Send (greedy, 8 tokens), as the page shows them."""
    screen = screen or Screen()
    return list(page.on_send(message, sid, editing, "", 0.0, 1.0, 8, 1.0, screen, request))


def test_an_edit_the_engine_refuses_goes_back_into_the_box_with_the_reason(on_page: tuple) -> None:
    """An edit is written only once the engine takes it: refused (here: the engine stopped),
    the page had cleared the box and left editing, and the text was nowhere."""
    engine, sm, page, owner, me = on_page
    sid = sent(page, me, "Name a colour.", None, None)[-1][2]
    before = sm.messages(owner, sid)
    mine = before[0]["id"]
    engine.shutdown()
    screen = Screen()
    chatbot, status, *_ = sent(page, me, "Name a fruit.", sid, mine, screen)[-1]
    assert status.startswith("Error:") and "shutting down" in status and "Send tries" in status
    assert page.on_given_back(screen) == ("Name a fruit.", mine)  # back in the box, editing
    assert page.on_given_back(screen) == (gr.skip(), None)  # once
    assert [m["content"] for m in chatbot] == [m["content"] for m in before]
    assert sm.messages(owner, sid) == before
    assert not sm._active  # the session is free for the next try


def test_a_conversation_deleted_as_its_turn_starts_leaves_no_turn_holding_the_user(
    on_page: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted in another tab between the turn's start and its stream: the turn was never
    iterated and kept its slot, so four of them (the per-user cap) locked the user out."""
    engine, sm, page, owner, me = on_page
    real_chat = sm.chat

    def chat_then_deleted_elsewhere(*args: object, **kwargs: object) -> object:
        turn = real_chat(*args, **kwargs)
        sm.delete_session(owner, turn.session_id)  # the other tab's Delete
        return turn

    monkeypatch.setattr(sm, "chat", chat_then_deleted_elsewhere)
    for _ in range(sm.config.max_turns_per_user + 1):
        sid = sm.create_session(owner)["id"]
        (_chatbot, status, *_), *rest = sent(page, me, "Hello.", sid, None)
        assert status.startswith("Error:") and not rest
    monkeypatch.setattr(sm, "chat", real_chat)
    *_, (chatbot, status, sid, *_rest) = sent(page, me, "Hi.", None, None)
    assert status == "" and chatbot[-1]["role"] == "assistant" and chatbot[-1]["content"]
    assert not sm._active


def test_a_reply_ending_as_the_user_leaves_does_not_leave_the_list_on_it(on_page: tuple) -> None:
    """The reply ends, selecting its conversation in the list, just before the click on
    another reaches the server: the list must end on the conversation shown, or a click back
    on the reply's (then the selected item) would change nothing and never open it."""
    _engine, sm, page, owner, me = on_page
    screen = Screen()
    other = sm.create_session(owner)["id"]
    sm.store.add_message(other, "user", "an older question")
    stream = page.on_send("Hi.", None, None, "", 0.0, 1.0, 4, 1.0, screen, me)
    *_, end = list(stream)  # ended while still on screen: the list marks the reply's
    assert end[3]["open"] == end[2]
    opened = page.on_select(other, screen, me)  # the click, answered after the end
    assert opened[0] == other and opened[4]["open"] == other


def test_every_event_that_changes_the_screen_refreshes_each_part_of_it_once(
    on_page: tuple,
) -> None:
    """The follow-ups of an event (sliders, usage) are chained once each: twice would run
    each refresh twice."""
    from collections import Counter

    from ui.chat_blocks import build_chat_blocks

    _engine, _sm, page, _owner, _me = on_page
    names = Counter(fn.name for fn in build_chat_blocks(page, 4).fns.values())
    follow_ups = {n: names[n] for n in ("on_show", "on_usage")}
    assert len(set(follow_ups.values())) == 1 and follow_ups["on_show"] > 1, follow_ups


def test_the_chats_own_clear_deletes_the_conversation_for_real(on_page: tuple) -> None:
    """Issue 56, defect 2: Gradio's clear (its trash icon) only emptied the chat on screen;
    the conversation stayed, and its next reply was answered with the hidden history."""
    _engine, sm, page, owner, me = on_page
    screen = Screen()
    sid = sent(page, me, "Hi.", None, None)[-1][2]
    screen.sid = sid
    shown_sid, chatbot, _status, _system, listing, *_ = page.on_clear(screen, me)
    assert shown_sid is None and chatbot == [] and listing["items"] == []
    assert sm.list_sessions(owner) == [] and sm.store.get_session(sid) is None


def test_a_reply_paints_less_often_while_more_replies_stream_at_once(
    on_page: tuple, monkeypatch
) -> None:
    """Every paint costs the server Python work (Gradio processes, diffs and sends the turn's
    outputs) that the model's steps wait for: the page as a whole paints at most PAINTS_PER_S
    times a second, so with four replies streaming each paints about every 4 / PAINTS_PER_S
    (up to MAX_PAINT_S)."""
    _engine, _sm, page, _owner, _me = on_page
    # 4 replies: a paint every 0.5 s each (40 tokens at 1 s took too few paints on a quiet box)
    monkeypatch.setattr(reply_stream, "PAINTS_PER_S", 8.0)
    monkeypatch.setattr(reply_stream, "MAX_PAINT_S", 5.0)
    gaps: list[list[float]] = []

    def reply(request: gr.Request) -> None:
        stream = page.on_send(
            "Write a long story about a lighthouse keeper.",
            None, None, "", 0.0, 1.0, 200, 1.0, Screen(), request,
        )  # fmt: skip
        times, text = [], ""
        for out in stream:
            if out[0][-1]["content"] != text:  # a paint that grew the reply
                text = out[0][-1]["content"]
                times.append(time.monotonic())
        inner = times[1:-1]  # the first text and the end paint at once
        gaps.append([b - a for a, b in itertools.pairwise(inner)])

    threads = [threading.Thread(target=reply, args=(browser(page)[1],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    spaced = sorted(g for each in gaps for g in each)
    assert len(gaps) == 4 and spaced, gaps
    assert spaced[len(spaced) // 2] >= 0.35, spaced  # alone, a reply paints every 0.1 s
