"""The crowd as one benchmark: the seed's own scenario, end to end, against crowdchat and the
servers people would otherwise run (vLLM-CPU, llama-server at its best thread count), each at
the same loads, one server at a time.

The load (bench/crowd_load.py): conversations arriving as a Poisson process, 6 rounds each with
an exponential think time, a ~300-token shared system prompt, varied messages, 64-token replies,
every request from this one client, each conversation naming its person in OpenAI's `user`
field (`--no-end-users`: none), as an app's backend would. Per arrival rate: TTFT, TPOT and
reply latency p50/p95/p99, errors (`refused`: HTTP 429s), and goodput (requests a second
within the SLO). A server's capacity is the highest rate at which `--attainment` of its
requests meet the SLO. `--ceiling` adds crowdchat's memory ceiling: a thousand conversations
open at once in sessions mode (minutes between their rounds) with a KV pool a tenth of the
crowd's KV, against the same crowd with a pool that keeps every one resident (returning users'
TTFT, restores, disk bytes, RSS over time). Prints one JSON object per
point, then a summary line; `--plot FILE.svg` draws goodput against arrival rate."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.crowd_load import Load, judge, run_load  # noqa: E402
from bench.machine import provenance  # noqa: E402
from bench.server import Server, free_port  # noqa: E402

SERVERS = ("crowdchat", "vllm", "llamacpp")


def capacity(points: list[dict], attainment: float) -> float | None:
    """The highest rate whose requests met the SLO at `attainment` or better, below the first
    rate that did not (a sweep past saturation does not count a lucky point beyond it)."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if (p["slo_attainment"] or 0) < attainment:
            break
        best = p["rate"]
    return best


def sweep(name: str, base: str, args: argparse.Namespace, mode: str) -> list[dict]:
    """Every rate against one ready server (a short warm-up first); stops past saturation."""
    warm = Load(rate=1.0, seconds=3, rounds=2, reply_tokens=8, mode=mode, seed=99)
    asyncio.run(run_load(base, warm, drain_s=120))
    points = []
    for i, rate in enumerate(args.rates):
        load = Load(
            rate,
            args.seconds,
            args.rounds,
            args.think_mean,
            args.reply_tokens,
            mode,
            i,
            end_users=not args.no_end_users,
        )
        crowd, wall = asyncio.run(run_load(base, load, drain_s=args.drain))
        point = {"server": name, "mode": mode, "rate": rate, "end_users": load.end_users}
        point |= judge(crowd, wall, args.slo_ttft, args.slo_tpot)
        print(json.dumps(point), flush=True)
        points.append(point)
        if (point["slo_attainment"] or 0) < args.stop_below:
            break  # far past this server's capacity: more load only takes the box's time
    return points


def run_server(name: str, args: argparse.Namespace) -> list[dict]:
    """Start one server, sweep it, stop it."""
    from bench.peers import prepare_llamacpp
    from bench.vllm_cpu import VllmSpec, prepare_model, prepare_vllm, serving

    logs = args.cache / "logs"
    if name == "crowdchat":
        server = Server(None, args.crowdchat_args.split())
        try:
            return sweep(name, server.base, args, "stateless") + (
                sweep(name, server.base, args, "sessions") if args.sessions else []
            )
        finally:
            server.stop()
    gguf, hf_dir = prepare_model(args.cache)
    port = free_port()
    if name == "vllm":
        spec = VllmSpec(prepare_vllm(args.cache), hf_dir, port, kv_gb=4, dtype=args.vllm_dtype)
        with serving(name, spec.command(), port, "/health", logs, spec.env()) as base:
            return sweep(name, base, args, "stateless")
    best: list[dict] = []
    for t in args.llamacpp_threads:  # its best thread count: the one with the highest capacity
        cmd = [str(prepare_llamacpp(args.cache)), "-m", str(gguf), "-np", str(args.slots)]
        cmd += ["-c", str(args.slots * 2048), "-t", str(t), "-tb", str(t)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        with serving(f"{name}-t{t}", cmd, port, "/health", logs) as base:
            points = [{**p, "threads": t} for p in sweep(f"{name}-t{t}", base, args, "stateless")]
        if not best or _better(points, best, args):
            best = points
    return best


def _better(a: list[dict], b: list[dict], args: argparse.Namespace) -> bool:
    ca, cb = capacity(a, args.attainment) or 0, capacity(b, args.attainment) or 0
    if ca != cb:
        return ca > cb
    return max(p["goodput_rps"] or 0 for p in a) > max(p["goodput_rps"] or 0 for p in b)


def ceiling(args: argparse.Namespace) -> dict:
    """crowdchat's memory ceiling: `--ceiling-conversations` conversations arriving over
    `--ceiling-seconds`, each pausing `--ceiling-think` seconds on average between its rounds
    (so most of them are open at once), in sessions mode. First with a pool that holds them all
    and no idle offload (every returning user finds their KV resident: the crowd's whole KV is
    the pool's peak), then with a pool a tenth of that and `--ceiling-idle`: idle conversations
    go to host RAM and disk and come back. RSS sampled every 30 s."""
    load = Load(
        rate=args.ceiling_conversations / args.ceiling_seconds,
        seconds=args.ceiling_seconds,
        rounds=args.rounds,
        think_mean_s=args.ceiling_think,
        reply_tokens=args.reply_tokens,
        mode="sessions",
        seed=7,
    )
    # one client holds the whole crowd's conversations: its per-user caps on kept and pending
    # conversations would refuse it (a team's app backend raises them the same way); snapshots
    # of every conversation fit on disk (none deleted for the disk budget: no recompute)
    common = ["--max-num-seqs", "64", "--max-queue", "4096", "--max-sessions-per-user", "0"]
    common += ["--max-pending-creates-per-user", "0", "--max-pending-creates", "0"]
    common += ["--kv-disk-budget-mb", str(args.ceiling_disk_mb), *args.crowdchat_args.split()]
    runs = {}
    pool_mb = None
    for label in ("unconstrained", "constrained"):
        if label == "unconstrained":
            budget, idle = args.ceiling_big_mb, 10**6  # nothing leaves the pool in the run
        else:
            budget, idle = pool_mb, args.ceiling_idle
        server = Server(None, [*common, "--kv-budget-mb", str(budget), "--idle-seconds", str(idle)])
        try:
            runs[label] = _watched(server, load, args, budget)
        finally:
            server.stop()
        runs[label]["idle_seconds"] = idle
        if label == "unconstrained":  # a tenth of the crowd's KV, by the blocks it used
            big = runs[label]
            per_block_mb = budget / max(big.pop("blocks_total"), 1)
            big["held_all"] = big["evictions"] == 0 and big["persists"] == 0
            big["crowd_kv_mb"] = round(big["kv_blocks_peak"] * per_block_mb, 1)
            pool_mb = max(8, round(big["crowd_kv_mb"] / 10))
        else:
            runs[label].pop("blocks_total")
        print(json.dumps({"ceiling": label, "kv_budget_mb": budget, **runs[label]}), flush=True)
    big, small = runs["unconstrained"], runs["constrained"]
    ratio = None
    if big.get("returning_ttft_p95_s") and small.get("returning_ttft_p95_s"):
        ratio = round(small["returning_ttft_p95_s"] / big["returning_ttft_p95_s"], 2)
    return {"ceiling_ttft_p95_ratio": ratio, "ceiling_pool_mb": pool_mb, "ceiling": runs}


def _watched(server: Server, load: Load, args: argparse.Namespace, budget: float) -> dict:
    """One ceiling run with the server's RSS, KV blocks and disk traffic watched."""
    import psutil

    proc = psutil.Process(server.proc.pid) if server.proc else None
    io0 = proc.io_counters() if proc else None
    before = server.metrics()
    rss: list[tuple[int, float]] = []
    peak_blocks = 0.0
    start = time.perf_counter()

    async def main() -> tuple:
        nonlocal peak_blocks

        async def watch() -> None:
            nonlocal peak_blocks
            while True:
                m = await asyncio.to_thread(server.metrics)
                used = m.get("crowdchat_kv_blocks_used", 0) + m.get("crowdchat_kv_blocks_cached", 0)
                peak_blocks = max(peak_blocks, used)
                now = time.perf_counter() - start
                if not rss or now - rss[-1][0] >= 30:
                    rss.append((round(now), round(server.rss_mb() or 0, 1)))
                await asyncio.sleep(2)

        watcher = asyncio.create_task(watch())
        try:
            return await run_load(server.base, load, drain_s=args.drain)
        finally:
            watcher.cancel()

    crowd, wall = asyncio.run(main())
    after = server.metrics()
    io1 = proc.io_counters() if proc else None

    def delta(prefix: str) -> float:
        return sum(v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix))

    five_min = [mb for t, mb in rss if t >= 300]
    out = judge(crowd, wall, args.slo_ttft, args.slo_tpot)
    out |= {
        "kv_blocks_peak": peak_blocks,
        "blocks_total": after.get("crowdchat_kv_blocks_total", 0),
        "restores": delta("crowdchat_session_restores_total"),
        "recomputes": delta("crowdchat_session_recomputes_total"),
        "persists": delta("crowdchat_session_persists_total"),
        "evictions": delta("crowdchat_session_evictions_total"),
        "disk_read_mb": round((io1.read_bytes - io0.read_bytes) / 2**20, 1) if io0 else None,
        "disk_written_mb": round((io1.write_bytes - io0.write_bytes) / 2**20, 1) if io0 else None,
        "rss_series_mb": rss,
        "rss_growth_after_5min_mb": round(max(five_min) - five_min[0], 1) if five_min else None,
    }
    return out


def summarize(results: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Capacities and their ratios; crowdchat's tail against its median and against vLLM's."""
    caps = {
        n: capacity([p for p in ps if p["mode"] == "stateless"], args.attainment)
        for n, ps in results.items()
    }
    out: dict[str, object] = {f"capacity_{n}_rps": c for n, c in caps.items()}
    mine = caps.get("crowdchat")
    for peer, key in (("vllm", "capacity_vs_vllm"), ("llamacpp", "capacity_vs_llamacpp")):
        out[key] = round(mine / caps[peer], 2) if mine and caps.get(peer) else None
    ours = [
        p
        for p in results.get("crowdchat", [])
        if p["mode"] == "stateless" and (mine is None or p["rate"] <= mine)
    ]
    tails = [p["tpot_p95_s"] / p["tpot_p50_s"] for p in ours if p["tpot_p50_s"]]
    out["tpot_p95_over_p50_max"] = round(max(tails), 2) if tails else None
    theirs = {p["rate"]: p for p in results.get("vllm", [])}
    vs = [
        p["latency_p95_s"] / theirs[p["rate"]]["latency_p95_s"]
        for p in ours
        if p["rate"] in theirs and p["latency_p95_s"] and theirs[p["rate"]]["latency_p95_s"]
    ]
    out["latency_p95_vs_vllm_max"] = round(max(vs), 2) if vs else None
    ttft_vs = [
        p["ttft_p95_s"] / theirs[p["rate"]]["ttft_p95_s"]
        for p in ours
        if p["rate"] in theirs and p["ttft_p95_s"] and theirs[p["rate"]]["ttft_p95_s"]
    ]
    out["ttft_p95_vs_vllm_max"] = round(max(ttft_vs), 2) if ttft_vs else None
    out["errors"] = sum(sum(p["errors"].values()) for ps in results.values() for p in ps)
    return out


def plot_svg(results: dict[str, list[dict]], path: Path) -> None:
    """Goodput against arrival rate, one line a server (stateless mode), as a small SVG."""
    colors = {"crowdchat": "#2563eb", "vllm": "#dc2626", "llamacpp": "#16a34a"}
    lines = {
        n: [(p["rate"], p["goodput_rps"] or 0) for p in ps if p["mode"] == "stateless"]
        for n, ps in results.items()
    }
    xs = [x for pts in lines.values() for x, _ in pts] or [1]
    ys = [y for pts in lines.values() for _, y in pts] or [1]
    w, h, pad = 640, 400, 50
    xmax, ymax = max(xs) * 1.05, max(max(ys) * 1.1, 0.1)

    def sx(x: float) -> float:
        return pad + x / xmax * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - y / ymax * (h - 2 * pad)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#444"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#444"/>',
        f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">'
        "arrival rate (new conversations a second)</text>",
        f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
        "goodput (requests/s within the SLO)</text>",
    ]
    for i in range(5):
        x, y = xmax * i / 4, ymax * i / 4
        parts.append(f'<text x="{sx(x)}" y="{h - pad + 16}" text-anchor="middle">{x:.2g}</text>')
        parts.append(f'<text x="{pad - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.2g}</text>')
    for k, (name, pts) in enumerate(sorted(lines.items())):
        color = colors.get(name.split("-")[0], "#555")
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in pts
        ]
        parts.append(f'<text x="{pad + 10}" y="{pad + 16 * k}" fill="{color}">{name}</text>')
    path.write_text("\n".join([*parts, "</svg>"]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--servers", default="crowdchat,vllm,llamacpp")
    ap.add_argument("--rates", default="0.5,1,1.5,2,3,4,5,6", help="conversations started a second")
    ap.add_argument("--seconds", type=float, default=60, help="how long conversations arrive")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--think-mean", type=float, default=5.0, help="seconds between rounds, mean")
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    ap.add_argument("--attainment", type=float, default=0.95)
    ap.add_argument("--stop-below", type=float, default=0.5, help="stop a sweep past this")
    ap.add_argument("--drain", type=float, default=300)
    ap.add_argument("--sessions", action="store_true", help="crowdchat in sessions mode too")
    ap.add_argument(
        "--crowdchat-args",
        default="",
        help="flags for app.py (default: its defaults, the limits on: the per-user ones count "
        "each conversation's end user, --tokens-per-minute-per-client the crowd)",
    )
    ap.add_argument(
        "--no-end-users",
        action="store_true",
        help="send no `user` field: the whole crowd is one user to the server's limits",
    )
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np")
    ap.add_argument("--llamacpp-threads", default="1,2")
    ap.add_argument("--vllm-dtype", default="auto")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "crowdchat" / "peers")
    ap.add_argument("--ceiling", action="store_true", help="crowdchat's memory ceiling runs too")
    ap.add_argument("--ceiling-conversations", type=int, default=1000)
    ap.add_argument("--ceiling-seconds", type=float, default=600, help="how long they arrive")
    ap.add_argument("--ceiling-think", type=float, default=300, help="seconds between rounds")
    ap.add_argument("--ceiling-idle", type=float, default=3, help="--idle-seconds, small pool")
    ap.add_argument("--ceiling-big-mb", type=float, default=8192, help="a pool holding them all")
    ap.add_argument("--ceiling-disk-mb", type=float, default=32768, help="--kv-disk-budget-mb")
    ap.add_argument("--plot", type=Path, help="an SVG of goodput against arrival rate")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.llamacpp_threads = [int(t) for t in args.llamacpp_threads.split(",")]
    if args.vllm_dtype == "auto":
        from bench.vllm_cpu import best_vllm_dtype

        args.vllm_dtype = best_vllm_dtype()
    args.cache.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.servers.split(",") if s]
    if unknown := set(names) - set(SERVERS):
        raise SystemExit(f"unknown servers: {sorted(unknown)} (known: {', '.join(SERVERS)})")
    results = {name: run_server(name, args) for name in names}
    summary = summarize(results, args)
    if args.ceiling:
        summary |= ceiling(args)
    if args.plot:
        plot_svg(results, args.plot)
    print(json.dumps({"summary": summary, "machine": provenance()}), flush=True)


if __name__ == "__main__":
    main()
