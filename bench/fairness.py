"""Does one heavy user starve the others? Each scenario under --schedule fcfs and fair, over HTTP.

crowdchat is started by this script (bench/server.py's `Server`), once per policy and scenario,
with the same flags but `--schedule`; the per-identity caps are raised (those of
`--tokens-per-minute`, `--max-turns-per-user`, ... that this build has) so the scheduler, not
the caps, is measured. Each owner is a client of its own (anonymous mode: a client is its
address, `stream_client.client_headers`); requests are one-off completions (no session),
streamed, EOS ignored.

- Protection: 4 light users in a closed loop (one request at a time, ~100-token prompt, 64 new
  tokens), first alone, then beside one heavy owner keeping 8 requests in flight (~1,500-token
  prompts, 256 new tokens). `light_ttft_p95_fair_over_fcfs` (target <= 0.25) and
  `light_ttft_p95_ratio_vs_alone` (fair; target <= 3.0).
- Share: `--max-num-seqs 8`; owners A, B, C keep 16, 4 and 1 requests outstanding (~200-token
  prompts, 128 new tokens). Tokens streamed to each owner in the window against the max-min fair
  share of the 8 batch slots (3.5 : 3.5 : 1): `share_error_max` = max |served share - fair
  share| / fair share (fair; target <= 0.15) and `share_error_max_fcfs`.
- `throughput_vs_fcfs`: tokens/s over both loaded phases, fair over fcfs (target >= 0.9).

Prints one JSON object per phase, then a summary JSON object (last line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fair_load import Owner, run_loads, wait_idle, warm_up  # noqa: E402
from bench.load import pct  # noqa: E402
from bench.mixed import cpu_name  # noqa: E402
from bench.server import ROOT, Server  # noqa: E402
from engine.core.fair_share import max_min_share  # noqa: E402

# Per-identity caps off (0) where this build has the flag: the scheduler is what is measured.
CAPS_OFF = (
    "--tokens-per-minute",
    "--max-turns-per-user",
    "--max-requests-per-user",
    "--max-sessions-per-user",
)
SHARE_OUTSTANDING = {"A": 16, "B": 4, "C": 1}


def light_ttfts(lights: list[Owner], t0: float, t1: float) -> list[float]:
    """TTFTs of requests sent in [t0, t1]; one still without a token when the phase ended
    counts as its wait so far (a lower bound), so a starved user is not left out."""
    done = [ttft for o in lights for sent, ttft in o.ttft if t0 <= sent <= t1]
    return done + [t1 - sent for o in lights for sent in o.unanswered if t0 <= sent <= t1]


def protection(server: Server, args: argparse.Namespace, policy: str) -> dict:
    lights = [Owner(f"light{i}") for i in range(4)]
    light_load = [(o, 1, args.light_prompt, args.light_new, 0.0) for o in lights]
    t0, t1 = asyncio.run(run_loads(server.base, light_load, args.alone_seconds))
    alone = light_ttfts(lights, t0, t1)
    wait_idle(server)
    lights = [Owner(f"light{i}") for i in range(4)]
    heavy = Owner("heavy")
    head = args.heavy_head_start  # the heavy owner is already busy when the light ones come
    loads = [
        (heavy, 8, args.heavy_prompt, args.heavy_new, 0.0),
        *[(o, 1, args.light_prompt, args.light_new, head) for o in lights],
    ]
    before = server.metrics().get("crowdchat_preemptions_total", 0)
    m0, m1 = asyncio.run(run_loads(server.base, loads, head + args.mixed_seconds))
    wait_idle(server)
    mixed = light_ttfts(lights, m0, m1)
    preempted = server.metrics().get("crowdchat_preemptions_total", 0) - before
    tokens = sum(o.tokens_between(m0, m1) for o in [heavy, *lights])
    out = {
        "scenario": "protection",
        "schedule": policy,
        "light_ttft_alone_p50_s": pct(alone, 50),
        "light_ttft_alone_p95_s": pct(alone, 95),
        "light_requests_alone": len(alone),
        "light_ttft_mixed_p50_s": pct(mixed, 50),
        "light_ttft_mixed_p95_s": pct(mixed, 95),
        "light_requests_mixed": len(mixed),
        "light_unanswered_mixed": sum(len(o.unanswered) for o in lights),
        "heavy_requests_started": len(heavy.ttft),
        "heavy_prompt_tokens": pct([float(x) for x in heavy.prompt_tokens], 50),
        "light_prompt_tokens": pct([float(x) for o in lights for x in o.prompt_tokens], 50),
        "mixed_tokens": round(tokens),
        "mixed_wall_s": round(m1 - m0, 2),
        "preemptions": preempted,
        "errors": sum(o.errors for o in [heavy, *lights]),
    }
    print(json.dumps(out), flush=True)
    return out


def share(server: Server, args: argparse.Namespace, policy: str) -> dict:
    owners = {name: Owner(name) for name in SHARE_OUTSTANDING}
    loads = [
        (owners[n], k, args.share_prompt, args.share_new, 0.0) for n, k in SHARE_OUTSTANDING.items()
    ]
    before = server.metrics().get("crowdchat_preemptions_total", 0)
    t0, t1 = asyncio.run(run_loads(server.base, loads, args.share_warmup + args.share_seconds))
    wait_idle(server)
    w0 = t0 + args.share_warmup
    served = {n: o.tokens_between(w0, t1) for n, o in owners.items()}
    total = sum(served.values()) or 1.0
    fair = max_min_share(SHARE_OUTSTANDING, args.share_slots)
    errors = {
        n: abs(served[n] / total - fair[n] / args.share_slots) / (fair[n] / args.share_slots)
        for n in owners
    }
    out = {
        "scenario": "share",
        "schedule": policy,
        "served_tokens": {n: round(v) for n, v in served.items()},
        "served_share": {n: round(v / total, 4) for n, v in served.items()},
        "fair_share": {n: round(f / args.share_slots, 4) for n, f in fair.items()},
        "share_error": {n: round(e, 4) for n, e in errors.items()},
        "share_error_max": round(max(errors.values()), 4),
        "tokens": round(total),
        "wall_s": round(t1 - w0, 2),
        "preemptions": server.metrics().get("crowdchat_preemptions_total", 0) - before,
        "errors": sum(o.errors for o in owners.values()),
    }
    print(json.dumps(out), flush=True)
    return out


def caps_off() -> list[str]:
    """The per-identity cap flags this build has, each set to 0 (off)."""
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    return [x for flag in CAPS_OFF if flag in help_text for x in (flag, "0")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--alone-seconds", type=float, default=15.0)
    ap.add_argument("--mixed-seconds", type=float, default=60.0)
    ap.add_argument("--heavy-head-start", type=float, default=10.0)
    ap.add_argument("--share-seconds", type=float, default=60.0)
    ap.add_argument("--share-warmup", type=float, default=5.0)
    ap.add_argument("--share-slots", type=int, default=8)
    ap.add_argument("--light-prompt", type=int, default=100)
    ap.add_argument("--light-new", type=int, default=64)
    ap.add_argument("--heavy-prompt", type=int, default=1500)
    ap.add_argument("--heavy-new", type=int, default=256)
    ap.add_argument("--share-prompt", type=int, default=200)
    ap.add_argument("--share-new", type=int, default=128)
    ap.add_argument("--policies", default="fcfs,fair")
    ap.add_argument(
        "--server-args",
        default="--kv-budget-mb 1536",
        help="flags for every crowdchat it starts (the same for both policies), "
        "e.g. '--target-itl-ms 300'",
    )
    args = ap.parse_args()
    data = tempfile.mkdtemp(prefix="crowdchat-fair-")  # one converted model for all starts
    common = [*args.server_args.split(), *caps_off(), "--data-dir", data]
    results: dict[str, dict[str, dict]] = {}
    for policy in args.policies.split(","):
        results[policy] = {}
        for scenario, run, extra in (
            ("protection", protection, []),
            ("share", share, ["--max-num-seqs", str(args.share_slots)]),
        ):
            server = Server(None, [*common, *extra, "--schedule", policy])
            try:
                warm_up(server)
                results[policy][scenario] = run(server, args, policy)
            finally:
                server.stop()
    summary: dict[str, object] = {
        "machine": f"{cpu_name()} {platform.machine()}",
        "server_args": " ".join(common[:-2]),
    }
    fair, fcfs = results.get("fair"), results.get("fcfs")
    if fair:
        p = fair["protection"]
        summary["light_ttft_p95_ratio_vs_alone"] = round(
            p["light_ttft_mixed_p95_s"] / p["light_ttft_alone_p95_s"], 3
        )
        summary["share_error_max"] = fair["share"]["share_error_max"]
    if fcfs:
        summary["share_error_max_fcfs"] = fcfs["share"]["share_error_max"]
    if fair and fcfs:
        summary["light_ttft_p95_fair_over_fcfs"] = round(
            fair["protection"]["light_ttft_mixed_p95_s"]
            / fcfs["protection"]["light_ttft_mixed_p95_s"],
            3,
        )

        def rate(r: dict) -> float:
            p, s = r["protection"], r["share"]
            return (p["mixed_tokens"] + s["tokens"]) / (p["mixed_wall_s"] + s["wall_s"])

        summary["throughput_vs_fcfs"] = round(rate(fair) / rate(fcfs), 3)
    for policy, r in results.items():
        summary[f"light_ttft_mixed_p95_s_{policy}"] = r["protection"]["light_ttft_mixed_p95_s"]
        summary[f"light_ttft_alone_p95_s_{policy}"] = r["protection"]["light_ttft_alone_p95_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
