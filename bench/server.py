"""The server a bench loads: crowdchat started in a subprocess on a free loopback port (behind
PROXY_ARGS), or one someone else runs (`--base`); its memory and its Prometheus counters."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# crowdchat started by a bench takes each bench user's X-Forwarded-For as the client's address
PROXY_ARGS = ["--trusted-proxy", "127.0.0.1"]


class Server:
    """crowdchat in a subprocess (behind PROXY_ARGS), or a server someone else runs (--base)."""

    def __init__(self, base: str | None, server_args: list[str]) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.data: str | None = None
        if base:
            self.base = base.rstrip("/")
            return
        port = free_port()
        data = self.data = tempfile.mkdtemp(prefix="crowdchat-load-")  # ~0.5 GB: stop() removes it
        log = Path(data) / "server.log"  # its stderr: the reason when it fails to start
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "app.py"),
                "--port",
                str(port),
                "--data-dir",
                data,
                *PROXY_ARGS,
                *server_args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:  # it exited: say why now, not after the deadline
                tail = log.read_text(errors="replace").splitlines()[-15:]
                self.stop()
                raise SystemExit("crowdchat exited while starting:\n" + "\n".join(tail))
            try:
                if httpx.get(self.base + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit("crowdchat did not start")

    def rss_mb(self) -> float | None:
        if self.proc is None:
            return None
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def metrics(self) -> dict[str, float]:
        """crowdchat's counters; empty for a server without (compatible) Prometheus metrics."""
        r = httpx.get(self.base + "/metrics", timeout=10)
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/plain"):
            return {}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                key = s.name + (
                    ""
                    if not s.labels
                    else "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                )
                out[key] = s.value
        return out

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
        if self.data is not None:
            shutil.rmtree(self.data, ignore_errors=True)
