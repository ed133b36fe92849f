"""Where a decode step's time goes: torch.profiler over engine decode steps, top ops by self time.

Loads the embedded model as the server does (`--quant nf4`, default flags), then profiles
`--repeats` decode steps of each row count in `--rows` (contexts `--context` tokens) and prints
one JSON line per row count: the step's median milliseconds and the top ops by self CPU time
(each op's share of the profiled time and its calls per step). Run it under the AVX2 emulation
of an AVX-512 machine with `make profile-avx2` (kernels built for x86-64-v3, PyTorch, oneDNN and
FBGEMM held to AVX2), or plainly for this CPU's own path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.kernel_speed import MODES, cpu_name, decode_step_s, load  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402
from engine.model.plan import StepPlan  # noqa: E402
from engine.sequence import Sequence  # noqa: E402


def top_ops(prof: profile, steps: int, limit: int) -> list[dict[str, object]]:
    """The `limit` ops of most self CPU time: name, share of the total, ms and calls per step."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "share": round(e.self_cpu_time_total / total, 3),
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "calls_per_step": round(e.count / steps, 1),
        }
        for e in events[:limit]
    ]


def cached_sequence(engine: Engine, ctx: int, new: int, seed: int) -> Sequence:
    """A sequence whose first `ctx` tokens are in the pool (prefilled) and `new` more known:
    a decode (`new` 1) or a returning user's message of `new` tokens after a cached prefix."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 20000, (ctx + new,), generator=gen).tolist()
    s = Sequence(ids, SamplingParams(temperature=0, max_new_tokens=8))
    s.block_table = engine.pool.allocate(engine.pool.blocks_for(ctx + new + 1))
    if ctx:
        engine.runner.forward(StepPlan(prefills=[(s, ctx)]))
    s.num_computed = ctx
    return s


def step_ms(engine: Engine, plan: StepPlan, repeats: int, around: object = None) -> float:
    """Median ms of `engine.runner.run(plan)` (the server's call: threads, forward, sampling),
    rerun on the same rows (each rewrites the same K/V slots), after one warm-up."""
    engine.runner.run(plan)
    times = []
    with around or nullcontext():
        for _ in range(repeats):
            t = time.perf_counter()
            engine.runner.run(plan)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def mixed(engine: Engine, args: argparse.Namespace) -> None:
    """Step ms of D decodes alone, D + k decodes, D decodes with one k-token chunk after P
    cached tokens, and that chunk alone: one JSON line per (D, k, P), and each line's marginal
    ms per added decode row and per prompt token."""
    ds = [int(x) for x in args.decodes.split(",")]
    ks = [int(x) for x in args.chunks.split(",")]
    ps = [int(x) for x in args.cached.split(",")]
    made: list[Sequence] = []

    def seq(ctx: int, new: int, seed: int) -> Sequence:
        made.append(cached_sequence(engine, ctx, new, seed))
        return made[-1]

    try:
        # the pool (256 MiB) holds a few thousand tokens: past 16 the decode rows repeat
        # sequences (each row still reads its whole context and writes its slot)
        distinct = [seq(args.context, 1, i) for i in range(16)]
        decodes = [distinct[i % 16] for i in range(max(ds) + max(ks))]
        chunks = {(k, p): seq(p, k, 1000 + k + p) for k in ks for p in ps}
        for d in ds:
            alone = step_ms(engine, StepPlan(decodes=decodes[:d]), args.repeats)
            for k in ks:
                more = step_ms(engine, StepPlan(decodes=decodes[: d + k]), args.repeats)
                for p in ps:
                    chunk = chunks[k, p]
                    with_chunk = StepPlan(decodes=decodes[:d], prefills=[(chunk, k)])
                    mix = step_ms(engine, with_chunk, args.repeats)
                    solo = step_ms(engine, StepPlan(prefills=[(chunk, k)]), args.repeats)
                    line = {
                        "decodes": d,
                        "chunk": k,
                        "cached": p,
                        "decode_context": args.context,
                        "decodes_ms": round(alone, 2),
                        "more_decodes_ms": round(more, 2),
                        "mixed_ms": round(mix, 2),
                        "chunk_alone_ms": round(solo, 2),
                        "ms_per_decode_row": round((more - alone) / k, 3),
                        "ms_per_prompt_token": round((mix - alone) / k, 3),
                        "stacked": engine.runner._stacks_prompt(with_chunk),
                    }
                    print(json.dumps(line), flush=True)
    finally:
        for s in made:
            engine.pool.free(s.block_table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,32", help="decode rows per step, comma-separated")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--mode", default="int4_default", choices=sorted(MODES))
    ap.add_argument("--mixed", action="store_true", help="time mixed steps (no profile)")
    ap.add_argument("--decodes", default="8,24", help="--mixed: decode rows D")
    ap.add_argument("--chunks", default="8,32,64,128", help="--mixed: prompt tokens k")
    ap.add_argument("--cached", default="0,300,800", help="--mixed: the chunk's cached prefix P")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        engine = load(MODES[args.mode], Path(tmp))
        if args.mixed:
            print(json.dumps({"machine": f"{cpu_name()}, {torch.get_num_threads()} threads"}))
            mixed(engine, args)
            return
        for rows in (int(r) for r in args.rows.split(",")):
            median_s = decode_step_s(engine, rows, args.context, args.repeats)  # also warms up
            prof = profile(activities=[ProfilerActivity.CPU])
            decode_step_s(engine, rows, args.context, args.repeats, around=prof)
            line = {
                "rows": rows,
                "step_ms": round(median_s * 1e3, 2),
                "tokens_per_s": round(rows / median_s, 1),
                "weights": engine.loaded.kernel,
                "kernel_isa": cpu_kernels.isa(),
                "aten_capability": torch.backends.cpu.get_cpu_capability(),
                "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
                "top": top_ops(prof, args.repeats, args.top),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
