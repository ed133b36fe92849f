"""The OpenAI-compatible API over a real server, engine and session manager: replies, streams,
sessions, errors, a full queue and a client that leaves. What /metrics shows is
tests/test_api_metrics.py's."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.chat_request import parse_params
from engine import SamplingParams
from engine.model.loader import LoadedModel
from tests.api_rig import HI, LONG, MODEL, LiveServer, owner, wait_for
from tests.conftest import close_sessions, make_sessions


def test_params_are_clamped_and_translated() -> None:
    p = parse_params({"max_tokens": 10**12, "top_k": -1, "temperature": 1e-9, "stop": "\n"}, 512)
    assert p == SamplingParams(temperature=0.0, max_new_tokens=512, stop=("\n",))
    assert parse_params({}, 4096).max_new_tokens == 256
    assert parse_params({"max_completion_tokens": 7}, 4096).max_new_tokens == 7
    # what some clients always send, as no-ops, passes
    noop = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    noop |= {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}
    assert parse_params(noop, 4096) == SamplingParams()
    p = parse_params(
        {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3}, 64
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1, 1.3)
    assert p.penalized and not SamplingParams().penalized


def test_openai_client_gets_replies_with_usage_and_streams(live: LiveServer) -> None:
    client = live.client()
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": parts}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 8


def test_max_tokens_is_honoured_with_ignore_eos(live: LiveServer) -> None:
    r = live.client().chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 2, "top_k": 5},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_models_lists_the_model(live: LiveServer) -> None:
    assert [m.id for m in live.client().models.list()] == [MODEL]


def test_a_session_continues_across_requests_and_is_private(live: LiveServer) -> None:
    auth = {"Authorization": "Bearer k1"}
    created = httpx.post(f"{live.url}/v1/sessions", headers=auth).json()
    assert created["object"] == "session"
    sid, client = created["id"], live.client()
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a large animal."}],
        max_tokens=6,
        temperature=0,
        extra_headers={"X-Session-Id": sid},
    )
    second = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Where does it live?"}],
        max_tokens=6,
        temperature=0,
        extra_headers={"X-Session-Id": sid},
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    msgs = live.sessions.messages(owner("k1"), sid)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[3]["content"] == second.choices[0].message.content

    # a turn still answering makes the next request on the session wait its turn: 409
    with httpx.stream(
        "POST",
        f"{live.url}/v1/chat/completions",
        headers={**auth, "X-Session-Id": sid},
        json={**LONG, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        busy = httpx.post(
            f"{live.url}/v1/chat/completions",
            json={"messages": HI},
            headers={**auth, "X-Session-Id": sid},
            timeout=30,
        )
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"

    # someone else's session and a made-up one look exactly alike
    bodies = []
    for key, target in (("k2", sid), ("k1", "0" * 32)):
        r = httpx.post(
            f"{live.url}/v1/chat/completions",
            json={"messages": HI},
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": target},
        )
        assert r.status_code == 404
        bodies.append(r.json())
    assert bodies[0] == bodies[1] and bodies[0]["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"messages": []}, "messages"),
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "temperature": 5}, "temperature"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "n": 2}, "n"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": HI, "frequency_penalty": "high"}, "frequency_penalty"),
        ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": HI, "logit_bias": {"42": 100}}, "logit_bias"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_requests_get_openai_style_400s(
    live: LiveServer, body: object, param: str | None
) -> None:
    url = f"{live.url}/v1/chat/completions"
    r = (
        httpx.post(url, content=body, timeout=30)
        if isinstance(body, bytes)
        else httpx.post(url, json=body, timeout=30)
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and "Traceback" not in error["message"]


def test_a_full_queue_gets_429_and_a_waiting_client_that_leaves_is_dropped(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sessions = make_sessions(nf4_model, tmp_path, {"max_queue": 1, "max_num_seqs": 1})
    server = LiveServer(engine, sessions)
    url = f"{server.url}/v1/chat/completions"
    try:
        ids = sessions.formatter.encode(HI)
        running = engine.submit(ids, SamplingParams(max_new_tokens=2000, ignore_eos=True))
        wait_for(lambda: engine.stats().running == 1, 10)

        outcome: list[object] = []

        def wait_in_queue() -> None:  # gives up before its turn comes
            try:
                outcome.append(httpx.post(url, json=LONG, timeout=httpx.Timeout(30, read=1.5)))
            except httpx.ReadTimeout as e:
                outcome.append(e)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_for(lambda: engine.stats().waiting == 1, 10)

        sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
        for headers in ({}, {"X-Session-Id": sid}):
            r = httpx.post(url, json=LONG, headers=headers, timeout=30)
            assert r.status_code == 429 and r.headers["Retry-After"]
            assert r.json()["error"]["code"] == "server_busy"
        waiter.join()
        assert isinstance(outcome[0], httpx.ReadTimeout)
        wait_for(lambda: engine.stats().waiting == 0, 5)  # its client left: cancelled
        assert not running.done
        running.cancel()
        wait_for(lambda: engine.stats().running == 0, 5)
        families = {
            f.name: f
            for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        }
        assert families["crowdchat_requests_rejected"].samples[0].value == 2
    finally:
        server.close()
        close_sessions(engine, sessions)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(live: LiveServer) -> None:
    engine = live.engine
    wait_for(lambda: engine.stats().running == 0, 5)
    before = engine.stats()
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST", f"{live.url}/v1/chat/completions", json={**LONG, "stream": True}
        ) as r:
            content = []
            for line in r.iter_lines():
                if '"content"' in line:
                    content.append(line)
                if len(content) >= 4:
                    break
            assert engine.stats().blocks_used > before.blocks_used
    wait_for(
        lambda: engine.stats().running == 0 and engine.stats().blocks_used == before.blocks_used, 5
    )
    assert engine.stats().requests_finished == before.requests_finished + 1
