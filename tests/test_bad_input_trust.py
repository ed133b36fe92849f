"""Untrusted bytes that once broke the server (issue 34): JSON nested past any sensible depth,
in a request body or in a snapshot's header, and upstream events that are not the objects
vLLM sends. Each becomes a clear refusal, a damaged file dropped once, or a failed replica."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from api.chat_request import MAX_JSON_DEPTH, parse_json_object
from api.errors import ApiError
from tests.fake_upstream import FakeReplica
from tests.offload_rig import Rig
from tests.test_bad_input import HI, post, url  # noqa: F401 - the fixture too
from tests.upstream_rig import ask, upstream_server, wait_for

DEEP = 100_000  # what the issue sent: far past Python's recursion limit


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


# -- request bodies ----------------------------------------------------------------------------
def test_the_parser_refuses_a_body_nested_past_the_limit_with_a_400() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 1000, DEEP):
        raw = ('{"messages": ' + nested(depth - 1) + "}").encode()
        with pytest.raises(ApiError, match=f"nested deeper than {MAX_JSON_DEPTH}") as err:
            parse_json_object(raw)
        assert err.value.status == 400
    with pytest.raises(ApiError, match="nested deeper"):
        parse_json_object(nested(DEEP).encode())


def test_the_parser_reads_a_body_at_the_limit_and_brackets_inside_strings_do_not_count() -> None:
    body = parse_json_object(('{"a": ' + nested(MAX_JSON_DEPTH - 1) + "}").encode())
    assert list(body) == ["a"]
    text = '\\"' + "[{" * DEEP  # an escaped quote does not end the string
    body = parse_json_object(json.dumps({"messages": HI, "content": text}).encode())
    assert body["content"] == text
    with pytest.raises(ApiError, match="not valid JSON"):  # still JSON's error, not depth's
        parse_json_object(b'{"a": [1, 2}')


def test_a_deeply_nested_body_over_http_is_a_400_and_the_server_keeps_serving(
    url: str,  # noqa: F811
) -> None:
    for raw in (nested(DEEP), '{"messages": ' + nested(DEEP) + "}"):
        r = post(url, raw.encode())
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"nested deeper than {MAX_JSON_DEPTH}" in error["message"]
    assert post(url, {"messages": HI, "max_tokens": 4}).status_code == 200


# -- snapshot headers --------------------------------------------------------------------------
def replace_header(path: Path, header: bytes) -> None:
    """Swap the safetensors header of the file at `path` for `header`, keeping its tensors."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])


def read_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.mark.parametrize("where", ["the header", "its fingerprint"])
def test_a_snapshot_header_nested_too_deep_is_a_damaged_file_dropped_once(
    rig: Rig,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    sid = rig.session("s")
    assert rig.off.persist(sid) and sid not in rig.engine.resident
    path = rig.files.path(sid)
    if where == "the header":
        replace_header(path, nested(DEEP).encode())
    else:
        header = read_header(path)
        header["__metadata__"]["fingerprint"] = nested(DEEP)
        replace_header(path, json.dumps(header).encode())
    with caplog.at_level(logging.WARNING):
        assert rig.off.restore(sid) == "cold"
    assert rig.off.restore_errors == 0 and "ignored, unreadable (RecursionError" in caplog.text
    assert not path.exists() and rig.store.get_snapshot(sid) is None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert rig.off.restore(sid) == "cold"  # the next return does not meet it again
    assert rig.off.restore_errors == 0 and "ignored" not in caplog.text


# -- upstream events ---------------------------------------------------------------------------
class MalformedReplica(FakeReplica):
    """A fake vLLM replica whose stream sends `good` well-formed tokens, then `event` (raw
    JSON where vLLM sends an object of its shape), then `[DONE]`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.event, self.good = "[]", 0

    async def _stream(self, body: dict) -> AsyncIterator[str]:
        for j in range(self.good):
            choice = {"index": 0, "text": f"w{j} ", "token_ids": [100 + j], "finish_reason": None}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        yield f"data: {self.event}\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def bad_first(
    local: tuple,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple]:
    """(url, backend, bad, good): every turn goes to `bad` while it is healthy (`good` is
    draining), and to `good` once `bad` is down."""
    bad, good = MalformedReplica("bad").start(), FakeReplica("good").start()
    try:
        with upstream_server([bad, good], tmp_path_factory.mktemp("malformed"), local) as s:
            base, backend, _sm, _monitor = s
            backend.drain(good.url)
            yield base, backend, bad, good
    finally:
        bad.stop()
        good.stop()


def ready(bad_first: tuple, event: str, good_tokens: int) -> tuple:
    base, backend, bad, good = bad_first
    wait_for(lambda: all(r.healthy for r in backend.router.replicas))  # the health checks
    bad.event, bad.good = event, good_tokens
    bad.requests.clear()
    good.requests.clear()
    return base, backend, bad, good


MALFORMED = [
    "[1, 2]",
    "7",
    "null",
    '"upstream hiccup"',
    '"error"',  # a string is not an error event, whatever it says
    '{"choices": "w1"}',
    '{"choices": [3]}',
    '{"choices": [{"text": 5}]}',
    '{"choices": [{"text": "w", "token_ids": "12"}]}',
    '{"choices": [], "usage": 5}',
    '{"choices": [], "usage": {"completion_tokens": "many"}}',
]


@pytest.mark.parametrize("event", MALFORMED)
def test_a_malformed_upstream_event_frees_the_slot_and_the_turn_fails_over(
    bad_first: tuple, event: str
) -> None:
    base, backend, bad, good = ready(bad_first, event, good_tokens=0)
    got = ask(base, "hello there")
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"].startswith("[good]")
    assert len(bad.requests) == 1 and len(good.requests) == 1
    assert [r.in_flight for r in backend.router.replicas] == [0, 0]
    down = {r.url: r for r in backend.stats().replicas}[bad.url]
    assert not down.healthy and "malformed event" in (down.last_error or "")


@pytest.mark.parametrize("event", ["[1, 2]", '"upstream hiccup"', '{"choices": [3]}'])
def test_a_malformed_event_mid_reply_keeps_the_part_and_frees_the_slot(
    bad_first: tuple, event: str
) -> None:
    base, backend, bad, good = ready(bad_first, event, good_tokens=2)
    got = ask(base, "hello there", stream=True)
    assert got.status_code == 200
    events = [json.loads(line[6:]) for line in got.text.splitlines() if line[6:7] == "{"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if "choices" in e)
    assert text == "w0 w1 "
    error = events[-1]["error"]["message"]
    assert "stopped in the middle of this reply" in error and "malformed event" in error
    assert len(good.requests) == 0  # tokens were shown: the turn is not replayed elsewhere
    assert [r.in_flight for r in backend.router.replicas] == [0, 0]
