"""Does one long conversation slow everyone else? Short users' inter-token latency, mixed.

31 short users decode in a closed loop through the engine API (each sends its ~100-token
prompt again when its reply of `--new-tokens` ends; EOS ignored). Phase one runs them alone;
phase two runs them again while one `--long-tokens` (6,000) conversation joins, prefills and
decodes `--long-new-tokens`. Each short token's arrival is stamped by one polling thread.
`mixed_itl_ratio` is the short users' ITL p50 during the long one's decode phase over their p50
without it (the target is <= 1.3); the overall ratio covers the whole second phase, prefill
chunks included. Prints one JSON object per phase and, last, a summary JSON object.

The short replies are long by default (2,000 tokens: the users decode through both phases, as
the issue has them). With short replies (`--new-tokens 32`, the default before 2026-12-02) a
step that carries a user's next prompt costs ~300 ms more on the 2-core EPYC (100 tokens of
prefill compute) and the ITL p50 lands on those steps or between them depending on how the
users' turns happen to bunch up, in either phase (2.0-3.0 measured, whatever the long one
cost). `--decode-attention gather` runs the engine's gather path instead of the CPU kernel, for
a before/after in one run.

Measured 2026-11-30 on the shared 2-core AMD EPYC (no AVX512; load average 6-16 from other
work), `--quant none --threads 1 --long-new-tokens 16 --kv-budget-mb 1024`, float32, the old
and new engine run side by side twice. mixed_itl_ratio: padded to the batch's longest 12.5 and
8.4; length groups 1.30 and 1.92. Short users' decode-phase ITL p50, same runs: 22.6 s -> 4.4 s
and 13.1 s -> 2.7 s; the long reply's 16 tokens: 359 s -> 66 s and 228 s -> 48 s. Absolute
figures are the load's, not the engine's: rerun on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import TEXT, pct  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.handle import RequestHandle  # noqa: E402
from engine.model.loader import LoadedModel, dtype_name, load_model  # noqa: E402

POLL_S = 0.001  # stamping resolution; a step takes tens of milliseconds


@dataclass
class ShortUser:
    """One closed-loop user: its current request and the gaps between its tokens."""

    prompt: list[int]
    handle: RequestHandle | None = None
    seen: int = 0
    last: float = 0.0
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (arrival time, gap)


def long_prompt(loaded: LoadedModel, n: int) -> list[int]:
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def short_prompts(loaded: LoadedModel, n: int, length: int) -> list[list[int]]:
    ids = loaded.tokenizer.encode(TEXT * 4, add_special_tokens=False)
    return [ids[i * 3 : i * 3 + length] for i in range(n)]


def run_phase(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    seconds: float,
    long: list[int] | None,
    long_new_tokens: int,
) -> dict:
    """Closed-loop short users for `seconds` once all of them have had a token (or, with a long
    conversation, which joins then, until it has finished). Reply lengths are staggered so the
    users' next prompts do not all arrive in the same step."""
    sps = [
        SamplingParams(temperature=0, max_new_tokens=new_tokens + i % 16, ignore_eos=True)
        for i in range(len(prompts))
    ]
    users = [ShortUser(p) for p in prompts]
    long_handle: RequestHandle | None = None
    long_first = long_end = warm = None
    t0 = time.perf_counter()
    for u, sp in zip(users, sps, strict=True):
        u.handle, u.last = engine.submit(u.prompt, sp), t0
    while True:
        now = time.perf_counter()
        if warm is None and all(u.seen for u in users):
            warm = now
        if long is not None and long_handle is None and warm is not None:
            long_sp = SamplingParams(temperature=0, max_new_tokens=long_new_tokens, ignore_eos=True)
            long_handle = engine.submit(long, long_sp)
        if long_handle is not None:
            if long_first is None and long_handle.num_generated_tokens:
                long_first = now
            if long_end is None and long_handle.done:
                long_end = now
        for u, sp in zip(users, sps, strict=True):
            n = u.handle.num_generated_tokens
            if n > u.seen:
                if u.seen and warm is not None:  # a first token's wait is a TTFT, not an ITL
                    gap = (now - u.last) / (n - u.seen)
                    u.gaps += [(now, gap)] * (n - u.seen)
                u.seen, u.last = n, now
            if u.handle.done:
                u.handle, u.seen, u.last = engine.submit(u.prompt, sp), 0, now
        if long is None and warm is not None and now - warm > seconds or long_end is not None:
            break
        time.sleep(POLL_S)
    for u in users:
        u.handle.cancel()
    gaps = [g for u in users for g in u.gaps]
    out = {
        "long": long is not None,
        "wall_s": round(time.perf_counter() - t0, 2),
        "short_tokens": len(gaps),
        "itl_p50_s": pct([g for _, g in gaps], 50),
        "itl_p95_s": pct([g for _, g in gaps], 95),
    }
    if long is not None:
        decode = [g for t, g in gaps if long_first <= t <= long_end]
        out |= {
            "long_ttft_s": round(long_first - warm, 2),
            "long_decode_s": round(long_end - long_first, 2),
            "decode_phase_short_tokens": len(decode),
            "decode_phase_itl_p50_s": pct(decode, 50),
            "decode_phase_itl_p95_s": pct(decode, 95),
        }
    while any(not u.handle.done for u in users):
        time.sleep(0.01)
    return out


def cpu_name() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.set_defaults(max_model_len=8192)
    ap.add_argument("--short-users", type=int, default=31)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=2000)
    ap.add_argument("--long-tokens", type=int, default=6000)
    ap.add_argument("--long-new-tokens", type=int, default=32)
    ap.add_argument("--alone-seconds", type=float, default=20.0)
    ap.add_argument(
        "--decode-attention",
        choices=("kernel", "gather"),
        default="kernel",
        help="the CPU kernel (where built) or the gather path (CUDA's)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    prompts = short_prompts(loaded, args.short_users, args.prompt_tokens)
    long = long_prompt(loaded, args.long_tokens)
    engine = Engine(config, loaded)
    if args.decode_attention == "gather":
        engine.runner.decode_kernel = None
    try:
        run_phase(engine, prompts[:4], 8, 2.0, None, 0)  # warm-up
        alone = run_phase(engine, prompts, args.new_tokens, args.alone_seconds, None, 0)
        print(json.dumps(alone), flush=True)
        mixed = run_phase(engine, prompts, args.new_tokens, 0, long, args.long_new_tokens)
        print(json.dumps(mixed), flush=True)
    finally:
        engine.shutdown()
    base = alone["itl_p50_s"]
    summary = {
        "device": str(loaded.device),
        "machine": f"{cpu_name()} {platform.machine()} {torch.get_num_threads()} threads",
        "quant": config.quant,
        "dtype": dtype_name(loaded.dtype),
        "short_users": args.short_users,
        "long_tokens": args.long_tokens,
        "new_tokens": args.new_tokens,
        "decode_attention": "kernel" if engine.runner.decode_kernel else "gather",
        "alone_itl_p50_s": base,
        "mixed_decode_itl_p50_s": mixed["decode_phase_itl_p50_s"],
        "mixed_overall_itl_p50_s": mixed["itl_p50_s"],
        "mixed_itl_ratio": round(mixed["decode_phase_itl_p50_s"] / base, 3),
        "mixed_overall_itl_ratio": round(mixed["itl_p50_s"] / base, 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
