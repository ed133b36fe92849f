"""The peer benchmark's helpers, load.py's stateless users, and its llama-server plumbing
against a stand-in server (no model, no real peers)."""

import argparse
import json
import time
from pathlib import Path

import psutil
import pytest

from bench import peers
from bench.machine import machine
from bench.peers import run_server, sdist_url, summarize
from bench.server import Server
from bench.stream_client import ReplyCount
from bench.vllm_cpu import add_vllm_dtype, best_vllm_dtype


def sse(event: dict) -> str:
    return "data: " + json.dumps(event)


def delta(text: str) -> str:
    return sse({"choices": [{"index": 0, "delta": {"content": text}}]})


def test_a_relative_sdist_url_resolves_against_the_pypi_json_address():
    meta = {
        "urls": [
            {"packagetype": "bdist_wheel", "url": "../../packages/aa/x.whl"},
            {"packagetype": "sdist", "url": "../../packages/bb/llama_cpp_python-0.3.36.tar.gz"},
        ]
    }
    assert sdist_url(meta) == "https://pypi.org/packages/bb/llama_cpp_python-0.3.36.tar.gz"


def test_an_absolute_sdist_url_is_kept():
    url = "https://files.pythonhosted.org/packages/bb/llama_cpp_python-0.3.36.tar.gz"
    assert sdist_url({"urls": [{"packagetype": "sdist", "url": url}]}) == url


def test_the_usage_chunk_gives_the_token_count_when_the_server_sends_one():
    reply = ReplyCount()
    lines = [delta("Hel"), "", delta("lo"), sse({"choices": [], "usage": {"completion_tokens": 5}})]
    assert [reply.feed(line) for line in [*lines, "data: [DONE]"]] == [1, 0, 1, 0, 0]
    assert (reply.tokens, reply.text, reply.failed) == (5, "Hello", False)


def test_without_a_usage_chunk_each_content_chunk_counts_as_a_token():
    reply = ReplyCount()
    role_only = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for line in [role_only, delta("a"), delta("b"), delta(""), delta("c"), "data: [DONE]"]:
        reply.feed(line)
    assert (reply.tokens, reply.text) == (3, "abc")


def test_an_error_event_marks_the_reply_failed():
    reply = ReplyCount()
    reply.feed(sse({"error": {"message": "boom"}}))
    assert reply.failed


def test_the_summary_holds_crowdchats_ratios_to_each_peer():
    def point(tps: float) -> dict:
        return {"tokens_per_s": tps, "ttft_p50_s": 0.1, "errors": {}}

    results = {
        "crowdchat": {1: point(30.0), 32: point(400.0)},
        "llamacpp": {1: point(100.0), 32: point(200.0)},
        "vllm": {1: point(40.0), 32: point(250.0)},
    }
    out = summarize(results, [1, 32])
    assert out["users_1_tokens_per_s"] == 30.0 and out["users_32_tokens_per_s"] == 400.0
    assert out["users_1_vs_llamacpp"] == 0.3
    assert out["users_32_vs_llamacpp"] == 2.0
    assert out["users_32_vs_vllm"] == 1.6
    assert out["vllm_users_32_tokens_per_s"] == 250.0
    assert out["llamacpp_users_1_ttft_p50_s"] == 0.1
    assert out["errors"] == 0


def test_a_skipped_peer_leaves_its_ratios_null_but_present():
    out = summarize(
        {"crowdchat": {1: {"tokens_per_s": 30.0, "ttft_p50_s": 0.1, "errors": {}}}}, [1]
    )
    assert out["users_1_vs_llamacpp"] is None
    assert out["users_32_vs_vllm"] is None and out["users_32_tokens_per_s"] is None


def test_the_machine_names_the_first_cpu_and_whether_it_has_avx512_bf16():
    info = "model name\t: Xeon X\nflags\t\t: sse avx512f avx512_bf16\n\nmodel name\t: Xeon X\n"
    assert machine(info)["cpu"] == "Xeon X" and machine(info)["avx512_bf16"] is True
    assert machine(info)["vector_extensions"] == ["avx512f", "avx512_bf16"]
    epyc = machine("model name: EPYC\nflags: sse fma avx avx2\n")
    assert epyc["avx512_bf16"] is False and epyc["vector_extensions"] == ["avx", "avx2", "fma"]


def test_a_bench_server_that_exits_while_starting_fails_at_once_saying_why(tmp_path):
    """bench/server.py's crowdchat died at start (here: no such model) and the bench waited
    out its whole start-up deadline (300 s), then said only that it did not start."""
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="model path not found: .*no-such-model"):
        Server(None, ["--ui", "off", "--model", str(tmp_path / "no-such-model")])
    assert time.monotonic() - t0 < 120


def test_vllm_runs_in_its_fastest_dtype_for_the_cpu_unless_told():
    assert best_vllm_dtype("model name: Xeon\nflags: avx512f avx512_bf16\n") == "bfloat16"
    assert best_vllm_dtype("model name: EPYC\nflags: avx2 fma\n") == "float32"
    ap = argparse.ArgumentParser()
    add_vllm_dtype(ap)
    assert ap.parse_args([]).vllm_dtype == best_vllm_dtype()
    assert ap.parse_args(["--vllm-dtype", "bfloat16"]).vllm_dtype == "bfloat16"


def test_llama_server_is_compared_at_its_best_thread_count_and_at_all_cores():
    def point(tps: float, by: dict | None = None) -> dict:
        extra = {"threads": max(by, key=by.get), "by_threads": by} if by else {}
        return {"tokens_per_s": tps, "ttft_p50_s": 0.1, "errors": {}, **extra}

    results = {
        "crowdchat": {1: point(45.0), 32: point(150.0)},
        "llamacpp": {1: point(56.0, {1: 56.0, 2: 28.0}), 32: point(100.0, {1: 65.0, 2: 100.0})},
    }
    out = summarize(results, [1, 32])
    assert out["users_1_vs_llamacpp_best"] == 0.8 and out["users_1_vs_llamacpp"] == 1.61
    assert out["users_32_vs_llamacpp_best"] == 1.5 and out["users_32_vs_llamacpp"] == 1.5
    assert out["llamacpp_users_1_best_threads"] == 1
    assert out["llamacpp_users_1_by_threads"] == {1: 56.0, 2: 28.0}


STUB = """#!/usr/bin/env python3
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
with open(sys.argv[0] + ".argv", "a") as f:
    f.write(" ".join(argv[:-1]) + "\\n")  # the port last: it differs each run

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/v1/models") else 501)
        self.end_headers()
        self.wfile.write(json.dumps({"data": [{"id": "stub"}]}).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with open(sys.argv[0] + ".requests", "a") as f:
            f.write(json.dumps(req) + "\\n")
        self.send_response(200)
        self.end_headers()
        for i in range(req["max_tokens"]):  # one token a chunk and no usage, like llama-server
            delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            self.wfile.write(("data: " + json.dumps(delta) + "\\n\\n").encode())
        self.wfile.write(b"data: [DONE]\\n\\n")

ThreadingHTTPServer(("127.0.0.1", int(argv[-1])), Handler).serve_forever()
"""


def test_llama_server_restarts_per_user_count_and_gets_each_users_whole_history(tmp_path):
    stub = tmp_path / "llama-server"
    stub.write_text(STUB)
    stub.chmod(0o755)
    args = argparse.Namespace(
        cache=tmp_path,
        threads=[1, 2],
        ctx_per_user=1024,
        turns=2,
        new_tokens=5,
        crowdchat_args="",
        neighbour=False,
    )
    ready = {"llamacpp": stub, "gguf": Path("/m.gguf")}
    points = run_server("llamacpp", [1, 3], args, ready)
    assert [points[n]["tokens"] for n in (1, 3)] == [10, 30]  # counted from content chunks
    assert all(set(points[n]["by_threads"]) == {1, 2} for n in (1, 3))
    assert all(points[n]["threads"] in (1, 2) for n in (1, 3))
    assert stub.with_suffix(".argv").read_text().splitlines() == [  # every thread count
        "-m /m.gguf -np 1 -c 1024 -t 1 -tb 1 --host 127.0.0.1 --port",
        "-m /m.gguf -np 1 -c 1024 -t 2 -tb 2 --host 127.0.0.1 --port",
        "-m /m.gguf -np 3 -c 3072 -t 1 -tb 1 --host 127.0.0.1 --port",
        "-m /m.gguf -np 3 -c 3072 -t 2 -tb 2 --host 127.0.0.1 --port",
    ]
    sent = [json.loads(line) for line in stub.with_suffix(".requests").read_text().splitlines()]
    second_turns = [r["messages"] for r in sent if len(r["messages"]) > 1]
    assert len(second_turns) == 2 * (1 + 3)
    assert all(m[1] == {"role": "assistant", "content": "t0 t1 t2 t3 t4 "} for m in second_turns)
    assert all(r["ignore_eos"] and r["model"] == "stub" for r in sent)


def test_the_neighbour_is_a_niced_busy_loop_only_while_measured():
    def busy() -> list[psutil.Process]:
        kids = psutil.Process().children(recursive=True)
        return [p for p in kids if "while True: pass" in " ".join(p.cmdline())]

    with peers.neighbour(False):
        assert busy() == []
    with peers.neighbour(True):
        deadline = time.monotonic() + 10  # `nice` lowers its priority, then becomes python
        while not (found := busy()) or found[0].nice() <= psutil.Process().nice():
            assert time.monotonic() < deadline, "no niced busy loop"
            time.sleep(0.05)
        (loop,) = found
    assert not loop.is_running() or loop.status() == psutil.STATUS_ZOMBIE
    assert busy() == []
