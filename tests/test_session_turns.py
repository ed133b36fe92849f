"""A session's turns off the happy path, on the real model: concurrent requests, a full
queue, and replies that replace others."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.loader import LoadedModel
from sessions.errors import SessionBusy
from tests.conftest import close_sessions, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
FORCED = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
Q1, Q2 = "Name a large animal.", "Where does it live?"


def test_a_request_that_reads_the_history_while_a_turn_ends_sees_its_reply(
    nf4_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        sid = sm.create_session("u")["id"]
        first = sm.chat("u", sid, Q1, FORCED)
        reading, go = threading.Event(), threading.Event()
        real = sm.store.messages

        def paused(session_id: str) -> list[dict]:  # the second request stops in its read
            if threading.current_thread().name == "second":
                reading.set()
                assert go.wait(60)
            return real(session_id)

        monkeypatch.setattr(sm.store, "messages", paused)
        outcome: dict[str, object] = {}

        def second() -> None:
            try:
                outcome["turn"] = sm.chat("u", sid, Q2, GREEDY)
            except SessionBusy as e:
                outcome["busy"] = e

        thread = threading.Thread(target=second, name="second")
        thread.start()
        deadline = time.monotonic() + 60
        while not reading.is_set() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        first.result()  # the first turn ends: its reply is committed, the session is free
        go.set()
        thread.join(60)
        assert first.text.strip()
        if "turn" in outcome:  # it got the session: its prompt must hold the reply
            turn = outcome["turn"]
            assert first.text.strip() in sm.formatter.tokenizer.decode(turn.prompt)
            turn.result()
        else:
            assert isinstance(outcome.get("busy"), SessionBusy)
        later = sm.chat("u", sid, Q2, GREEDY)  # once it ended, the session is free again
        assert first.text.strip() in sm.formatter.tokenizer.decode(later.prompt)
        later.result()
    finally:
        close_sessions(engine, sm)
