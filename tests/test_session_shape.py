"""The session layer's shape, without a model: one Reply protocol, one relay, a turn that is
given everything it needs, session errors and states owned by sessions/, no import circle."""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.errors
from engine import CrowdchatError, FinishReason, RequestHandle, SamplingParams
from sessions import ChatTurn, Reply, SessionState
from sessions.errors import RateLimited, SessionBusy, SessionNotFound
from sessions.relay import Delta, End, Failed, RelayThread, relay
from sessions.reply import OneOffReply

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (also inside TYPE_CHECKING blocks)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def finished_handle(
    deltas: list[str], reason: FinishReason = FinishReason.STOP, error: str | None = None
) -> RequestHandle:
    """A handle as the engine leaves it after streaming `deltas` (no engine needed)."""
    handle = RequestHandle(1, 7, cancel=lambda _id: None)
    for d in deltas:
        handle.token_ids.append(0)
        handle._push(d)
    handle._finish(reason, error)
    return handle


def test_no_session_module_imports_the_manager_and_the_engine_knows_no_sessions() -> None:
    for path in (ROOT / "sessions").glob("*.py"):
        if path.name != "__init__.py":
            assert "sessions.manager" not in imports_of(path) or path.name == "manager.py", path
    for path in (ROOT / "engine").glob("*.py"):
        assert not any(m.startswith("sessions") for m in imports_of(path)), path
    assert not hasattr(engine.errors, "SessionBusy")


def test_the_api_and_the_pages_reach_sessions_only_through_their_public_face() -> None:
    for name in (
        "api/openai_api.py",
        "api/metrics.py",
        "ui/monitor.py",
        "ui/admin_page.py",
        "ui/chat_page.py",
    ):
        text = (ROOT / name).read_text()
        for private in (".offload", ".store.", ".limiter", "ChatFormatter", "recomputes ="):
            assert private not in text, (name, private)


def test_session_errors_are_crowdchat_errors_and_states_equal_their_strings() -> None:
    for cls in (SessionNotFound, SessionBusy, RateLimited):
        assert issubclass(cls, CrowdchatError)
    assert [str(s) for s in SessionState] == ["active", "resident", "persisted", "cold"]
    assert SessionState.PERSISTED == "persisted" and "cold" in (SessionState.COLD,)


def test_a_turn_runs_on_what_it_was_given_and_ends_exactly_once() -> None:
    ended: list[ChatTurn] = []
    submitted: list[tuple[list[int], SamplingParams]] = []

    def submit(prompt: list[int], params: SamplingParams) -> RequestHandle:
        submitted.append((prompt, params))
        return finished_handle(["Hel", "lo"])

    params = SamplingParams(max_new_tokens=4)
    turn = ChatTurn(
        "s" * 32,
        [1, 2, 3],
        params,
        restore=lambda: "disk",
        submit=submit,
        queue_position=lambda _h: None,
        on_end=ended.append,
    )
    assert isinstance(turn, Reply) and turn.queue_position() is None
    assert turn.result() == "Hello"
    assert submitted == [([1, 2, 3], params)] and ended == [turn]
    assert (turn.restored_from, turn.finish_reason, turn.status) == ("disk", "stop", "done")
    assert (turn.num_prompt_tokens, turn.num_generated_tokens) == (7, 2)


def test_a_turn_that_fails_reports_the_error_and_still_ends() -> None:
    ended: list[ChatTurn] = []
    turn = ChatTurn(
        "s" * 32,
        [1],
        SamplingParams(),
        restore=lambda: "cold",
        submit=lambda p, s: finished_handle(["x"], FinishReason.ERROR, "boom"),
        queue_position=lambda _h: 0,
        on_end=ended.append,
    )
    with pytest.raises(CrowdchatError, match="boom"):
        turn.result()
    assert ended == [turn] and turn.finish_reason == "error" and turn.error == "boom"


def test_a_one_off_reply_is_a_reply_without_a_session() -> None:
    reply = OneOffReply(finished_handle(["a", "b"], FinishReason.LENGTH), lambda _h: 3)
    assert isinstance(reply, Reply) and reply.restored_from is None
    assert "".join(reply) == "ab" and reply.queue_position() == 3
    assert (str(reply.finish_reason), reply.num_prompt_tokens, reply.num_generated_tokens) == (
        "length",
        7,
        2,
    )


def test_the_relay_hands_out_typed_events_and_closes_the_stream() -> None:
    closed = []

    def deltas() -> Iterator[str]:
        try:
            yield "a"
            yield "b"
        finally:
            closed.append(True)

    events: list[object] = []
    relay(deltas(), events.append)
    assert events == [Delta("a"), Delta("b"), End()] and closed == [True]

    def failing() -> Iterator[str]:
        yield "a"
        raise CrowdchatError("no more")

    events.clear()
    relay(failing(), events.append)
    assert events[0] == Delta("a") and isinstance(events[1], Failed)
    assert str(events[1].error) == "no more"

    events.clear()
    relay(deltas(), events.append, stopped=lambda: True)  # the reader left
    assert events == [End()]


def test_a_relay_thread_reports_nothing_yet_while_the_reply_waits() -> None:
    def slow() -> Iterator[str]:
        time.sleep(0.3)
        yield "late"

    events = RelayThread(slow(), "test-relay")
    assert events.get(timeout=0.01) is None  # the page polls its status line meanwhile
    assert events.get(timeout=5) == Delta("late")
    assert events.get(timeout=5) == End()
