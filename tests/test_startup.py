"""A first start says what it is doing: each step logged with its time, quantizing with a
percentage, and the server answers from the first moment with the step (page, API, /health)
instead of refusing connections."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.server import free_port
from engine.startup import STEPS, Startup

ROOT = Path(__file__).resolve().parent.parent


def test_steps_are_numbered_timed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    startup = Startup()
    assert startup.describe() == "starting"
    with caplog.at_level(logging.INFO, logger="crowdchat.startup"):
        with startup.step("quantizing the model"):
            startup.progress(0.42)
            assert startup.describe() == "quantizing the model (4/6, 42%)"
            startup.progress(0.47)  # within the same tenth: not logged again
        with pytest.raises(RuntimeError), startup.step("sizing the KV pool"):
            raise RuntimeError("a step that fails is still timed")
        startup.finish()
    said = [r.getMessage() for r in caplog.records]
    assert said[:2] == [
        "starting: quantizing the model (4/6)",
        "starting: quantizing the model (4/6, 42%)",
    ]
    assert any(m.startswith("starting: quantizing the model took ") for m in said)
    assert any(m.startswith("starting: sizing the KV pool took ") for m in said)
    assert said[-1].startswith("started in ")
    assert set(startup.took) == {"quantizing the model", "sizing the KV pool"}
    assert startup.describe() == "ready"
    startup.fail("no such model")
    assert startup.describe() == "failed: no such model"
    assert len(STEPS) == 6


def test_a_first_start_answers_at_once_with_its_step(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), "--data-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, httpx.Response] = {}
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                models = httpx.get(base + "/v1/models", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if models.status_code == 200:
                break
            seen.setdefault("api", models)
            seen.setdefault("page", httpx.get(base + "/", timeout=5))
            seen.setdefault("health", httpx.get(base + "/health", timeout=5))
            time.sleep(0.1)
        else:
            raise AssertionError("crowdchat did not start")
        # a fresh data dir: the GGUF is converted, so the start takes seconds, all answered
        api, page, health = seen["api"], seen["page"], seen["health"]
        assert api.status_code == 503 and api.json()["error"]["code"] == "starting"
        assert api.headers["retry-after"] == "3"
        assert page.status_code == 503 and "crowdchat is starting" in page.text
        assert 'http-equiv="refresh"' in page.text
        assert health.status_code == 503 and health.json()["status"] == "starting"
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert "crowdchat" in httpx.get(base + "/", timeout=5).text
        # a browser tab keeps Gradio's heartbeat stream open for as long as it is open: Ctrl-C
        # waited on it for ever (uvicorn waits for every connection to close)
        tab = httpx.Client(timeout=10)
        tab.send(tab.build_request("GET", base + "/gradio_api/heartbeat/tab0"), stream=True)
        # SIGTERM (systemd, docker) killed the process once uvicorn had stopped: the KV of
        # the conversations in memory was never written
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, "a stop waited on an open tab"
        assert proc.returncode == 0, out[-3000:]
        assert "stopped: every conversation's KV" in out
        assert "Traceback" not in out, out[-3000:]
        tab.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            out, _ = proc.communicate(timeout=60)
    for step in STEPS:  # every step of a CPU start, in order, each with its time
        assert f"starting: {step} took " in out, (step, out[-3000:])
    assert "starting: quantizing the model (4/6, 100%)" in out
    assert "started in " in out and "crowdchat: chat on " in out
