"""A dead engine thread is loud: /health and /metrics say so, new work gets 503, nothing hangs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.model.loader import LoadedModel
from tests.api_rig import HI, MODEL, LiveServer
from tests.conftest import close_sessions, make_sessions


def gauge(url: str, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
    return next(s.value for f in families for s in f.samples if s.name == name)


def test_a_failed_engine_thread_shows_on_health_and_metrics_and_refuses_with_503(
    nf4_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sessions = make_sessions(nf4_model, tmp_path)
    server = LiveServer(engine, sessions)
    try:
        ok = httpx.get(f"{server.url}/health", timeout=30)
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        assert gauge(server.url, "crowdchat_engine_up") == 1

        def broken(budget: int) -> object:
            raise MemoryError("injected outside the step")

        monkeypatch.setattr(engine.scheduler, "schedule", broken)
        body = {"model": MODEL, "messages": HI, "max_tokens": 8}
        first = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert first.status_code >= 500  # the request in flight fails, and says why
        assert "engine failed" in first.json()["error"]["message"]
        again = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert again.status_code == 503 and "engine failed" in again.text
        down = httpx.get(f"{server.url}/health", timeout=30)
        assert down.status_code == 503 and "MemoryError" in down.json()["problems"][0]
        assert gauge(server.url, "crowdchat_engine_up") == 0
    finally:
        server.close()
        close_sessions(engine, sessions)
