"""--ui off: an API server (as `vllm serve`): the OpenAI API and /metrics on the real model,
no chat or admin page, and Gradio never imported (a GPU box carries no Gradio)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.server import free_port
from engine.model.loader import LoadedModel

ROOT = Path(__file__).resolve().parent.parent


def test_an_api_only_server_answers_the_api_and_never_imports_gradio(
    nf4_model: LoadedModel, model_dir: Path, tmp_path: Path
) -> None:
    converted = next(p for p in (model_dir / "models").iterdir() if p.is_dir())  # nf4_model's
    port = free_port()
    log = tmp_path / "server.log"  # a file: the import log would fill a pipe nobody reads yet
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "app.py", "--ui", "off", "--port", str(port),
         "--data-dir", str(tmp_path), "--model", str(converted)],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the API-only server did not start: " + log.read_text()[-2000:])
        body = {
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(
            (json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for e in events[:-1]
        )
        assert text.strip()
        home = httpx.get(base + "/", timeout=10)
        assert home.status_code == 200 and "--ui off" in home.text
        assert "/v1/chat/completions" in home.text
        admin = httpx.get(base + "/admin", timeout=10)
        assert admin.status_code == 404 and "--ui off" in admin.text
        assert httpx.get(base + "/admin/anything", timeout=10).status_code == 404
        metrics = httpx.get(base + "/metrics", timeout=10)
        assert metrics.status_code == 200 and "crowdchat_" in metrics.text
    finally:
        proc.terminate()
        proc.wait(60)
    out = log.read_text()
    assert "crowdchat: API on " in out, out[-2000:]
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if "import time:" in line
    ]
    assert "fastapi" in imported  # the import log is there
    assert not [m for m in imported if m.split(".")[0] == "gradio"], "gradio was imported"
