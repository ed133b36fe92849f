"""crowdchat over upstream engines (--engine-url): the real app, session layer and SQLite in
front of two fake vLLM replicas (real HTTP servers, tests/fake_upstream.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import (
    Backend,
    EngineConfig,
    InvalidRequest,
    ModelLoadError,
    SamplingParams,
)
from engine.upstream.backend import UpstreamBackend
from engine.upstream.routing import Router, parse_metrics, score
from engine.upstream.stream import completion_body, sse_lines
from tests.fake_model import fake_engine
from tests.web import free_port


# -- the seam -------------------------------------------------------------------------------
def test_both_backends_satisfy_the_protocol(served, tmp_path: Path) -> None:  # noqa: ANN001
    engine, _runner = fake_engine(32, data_dir=tmp_path)
    try:
        assert isinstance(engine, Backend) and engine.keeps_kv
        assert isinstance(served[1], Backend) and not served[1].keeps_kv
        for name in ("submit", "stats", "queue_position", "wait_estimate", "drain", "drop_kv"):
            assert callable(getattr(engine, name)) and callable(getattr(served[1], name))
    finally:
        engine.shutdown()


def test_rendezvous_is_sticky_spread_and_moves_only_a_lost_replicas_keys() -> None:
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    router = Router(urls)
    keys = [f"session-{i}" for i in range(300)]
    first = {k: router.pick(k).url for k in keys}
    assert {k: router.pick(k).url for k in keys} == first  # sticky
    counts = {u: list(first.values()).count(u) for u in urls}
    assert min(counts.values()) > 60, counts  # spread (100 each on average)
    router.mark_down(router.replicas[1], "test")
    after = {k: router.pick(k).url for k in keys}
    moved = [k for k in keys if after[k] != first[k]]
    assert moved and all(first[k] == "http://b:1" for k in moved)
    assert max(urls, key=lambda u: score("session-0", u)) == first["session-0"]


def test_vllm_metrics_are_read_and_missing_ones_tolerated() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 40.0\n'
        'vllm:prefix_cache_hits_created{model_name="m"} 1.7e9\n'
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        "llamacpp:tokens_predicted_total 7\n"
    )
    assert parse_metrics(text) == {"num_requests_running": 5.0, "prefix_cache_hits": 40.0}


def test_the_request_body_maps_sampling_and_keeps_the_reply_inside_the_context() -> None:
    plain = completion_body("m", [5, 6, 7], SamplingParams(max_new_tokens=100), 50)
    assert plain["prompt"] == [5, 6, 7] and plain["max_tokens"] == 47
    assert not {"top_k", "min_tokens", "seed", "stop", "ignore_eos"} & set(plain)
    p = SamplingParams(top_k=5, min_new_tokens=2, seed=0, stop=("x",), ignore_eos=True)
    full = completion_body("m", [1], p, 4096)
    assert (full["top_k"], full["min_tokens"], full["seed"]) == (5, 2, 0)
    assert (full["stop"], full["ignore_eos"], full["max_tokens"]) == (["x"], True, 256)
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty"} & set(full)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=1, repetition_penalty=1.2)
    pen = completion_body("m", [1], p, 4096)
    assert (pen["presence_penalty"], pen["frequency_penalty"], pen["repetition_penalty"]) == (
        0.5,
        1,
        1.2,
    )


def test_sse_payloads_are_cut_at_whole_lines_even_inside_a_character() -> None:
    event = 'data: {"text": "é"}\r\n\n'.encode()
    cut = event.index("é".encode()) + 1  # between the two bytes of é
    first, rest = sse_lines(b": ping\n" + event[:cut])
    assert first == [] and rest == event[:cut]
    second, rest = sse_lines(rest + event[cut:] + b"data: [DONE]\n\ndata: {")
    assert second == ['{"text": "é"}'.encode(), b"[DONE]"] and rest == b"data: {"


def test_bad_urls_and_unreachable_upstreams_stop_start_up_with_a_message(
    local: tuple, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequest, match="--engine-url"):
        EngineConfig(engine_url="127.0.0.1:8000")
    with pytest.raises(InvalidRequest, match="--engine-url"):
        EngineConfig(engine_url=" , ")
    config = EngineConfig(
        data_dir=tmp_path, engine_url=f"http://127.0.0.1:{free_port()}", upstream_wait_s=0.3
    )
    with pytest.raises(ModelLoadError, match="no --engine-url server answered"):
        UpstreamBackend(config, local=local)


# -- chat over the API and the session layer -------------------------------------------------
