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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.kernel_speed import MODES, cpu_name, decode_step_s, load  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,32", help="decode rows per step, comma-separated")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--mode", default="int4_default", choices=sorted(MODES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        engine = load(MODES[args.mode], Path(tmp))
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
