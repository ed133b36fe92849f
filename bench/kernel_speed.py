"""Which weight kernel is fastest here? One engine decode step, timed per kernel and row count.

Loads the embedded model once per mode (`--quant nf4` as the server runs it: crowdchat's 4-bit
kernel where compute is float32 (engine.kernels.cpu_kernels), else PyTorch's, with the default dense
copy: none on crowdchat's AVX512-BF16 kernel, FBGEMM's float16 above 4 rows where compute is
float32 otherwise, else a copy in the compute dtype above 16; the same on PyTorch's int4 kernel;
with the compute-dtype copy above 16 rows, as before FBGEMM; packed only; bitsandbytes nf4; and
`--quant none`), then times a decode step of 1, 8 and 32 sequences (contexts ~100 tokens) and a
500-token prefill, in interleaved rounds so that a noisy machine slows every mode alike. One
JSON line per mode, then a summary with each mode's step times over bitsandbytes' and the
machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the engine first: it sets OpenMP's passive waits before torch loads libgomp (engine/threads.py),
# so this measures the same threads the server runs, not spinning ones
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402, I001
from engine.model import cpu_quant, fused_proj
from engine.kernels import cpu_kernels  # noqa: E402
from engine.model import runner as model_runner

import torch  # noqa: E402
from engine.model.loader import dtype_name, load_model  # noqa: E402
from engine.model.plan import StepPlan  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

MODES = {
    "int4_default": {"quant": "nf4"},
    # the AVX512 4-bit kernel with bfloat16 activations, not int8 ones (--cpu-activations)
    "int4_bf16_activations": {"quant": "nf4", "cpu_activations": "bfloat16"},
    # PyTorch's int4 kernel where crowdchat's would run (before it)
    "torch_int4_kernel": {"quant": "nf4", "torch_q4": True},
    # the dense copy in the compute dtype above 16 rows (the default before FBGEMM's float16)
    "torch_int4_dense_above_16": {"quant": "nf4", "cpu_dense_above": 16, "no_fp16": True},
    # the same without issue 9's cuts (q/k/v and gate/up fused, one-op RMSNorm): before/after
    # in one run
    "torch_int4_unfused": {"quant": "nf4", "unfused": True},
    # decode steps through engine.model.lean_llama's general loop, not `_decodes` on
    # crowdchat's glue
    # kernels (RoPE + K/V write, attention, projections called straight)
    "int4_layer_loop": {"quant": "nf4", "loop": True},
    # the default path through transformers' Llama code instead of engine.model.lean_llama
    "torch_int4_transformers_forward": {"quant": "nf4", "hf": True},
    "torch_int4_packed_only": {"quant": "nf4", "cpu_dense_above": 0},
    "bitsandbytes_nf4": {"quant": "nf4", "bnb": True},
    "dense": {"quant": "none"},
    # float32 compute where bfloat16 is native: crowdchat's kernels instead of PyTorch's bf16 ones
    "int4_float32": {"quant": "nf4", "dtype": "float32"},
    "dense_float32": {"quant": "none", "dtype": "float32"},
}
ROWS = (1, 2, 4, 6, 8, 32)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def load(mode: dict, data_dir: Path) -> Engine:
    flags = ("bnb", "unfused", "hf", "no_fp16", "torch_q4", "loop")
    settings = {k: v for k, v in mode.items() if k not in flags}
    config = EngineConfig(data_dir=data_dir, kv_budget_mb=256, **settings)  # type: ignore[arg-type]
    available, fp16, fuse, norms, q4 = (
        cpu_quant.available,
        cpu_quant.fp16_gemm_available,
        fused_proj.fuse_projections,
        model_runner.fuse_norms,
        cpu_kernels.q4_linear,
    )
    if mode.get("bnb"):
        cpu_quant.available = lambda: False  # the loader then takes bitsandbytes
    if mode.get("torch_q4"):
        cpu_kernels.q4_linear = lambda: None
    if mode.get("no_fp16"):
        cpu_quant.fp16_gemm_available = lambda: False
    if mode.get("unfused"):
        fused_proj.fuse_projections = lambda *a: 0
        model_runner.fuse_norms = lambda *a: 0
    try:
        loaded = load_model(config)
        engine = Engine(config, loaded)
    finally:
        cpu_quant.available, fused_proj.fuse_projections = available, fuse
        cpu_quant.fp16_gemm_available = fp16
        model_runner.fuse_norms = norms
        cpu_kernels.q4_linear = q4
    engine.shutdown()  # drive the runner on this thread
    if mode.get("hf"):
        engine.runner.lean = None  # type: ignore[attr-defined]
    if mode.get("loop"):
        engine.runner.lean.kernel_decodes = False  # type: ignore[attr-defined]
    return engine


def decode_step_s(
    engine: Engine, rows: int, ctx: int, repeats: int, around: AbstractContextManager | None = None
) -> float:
    """Median seconds of one decode step of `rows` sequences with `ctx` tokens of context;
    `around` (a profiler) wraps the timed steps only, not their prefills."""
    gen = torch.Generator().manual_seed(rows)
    seqs = []
    for _ in range(rows):
        ids = torch.randint(100, 20000, (ctx,), generator=gen).tolist()
        s = Sequence(ids, SamplingParams(temperature=0, max_new_tokens=8))
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(ctx + repeats + 1))
        engine.runner.forward(StepPlan(prefills=[(s, ctx)]))
        s.num_computed = ctx
        s.token_ids.append(28)
        seqs.append(s)
    times = []
    try:
        with around or nullcontext():
            for _ in range(repeats):
                t = time.perf_counter()
                engine.runner.forward(StepPlan(decodes=seqs))
                times.append(time.perf_counter() - t)
    finally:
        for s in seqs:
            engine.pool.free(s.block_table)
    return statistics.median(times)


def prefill_s(engine: Engine, tokens: int) -> float:
    ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    s = Sequence(ids, SamplingParams(temperature=0, max_new_tokens=1))
    s.block_table = engine.pool.allocate(engine.pool.blocks_for(tokens))
    try:
        t = time.perf_counter()
        engine.runner.forward(StepPlan(prefills=[(s, tokens)]))
        return time.perf_counter() - t
    finally:
        engine.pool.free(s.block_table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="decode steps timed per point")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="over rounds; min on a shared box, where other work only ever adds time",
    )
    args = ap.parse_args()
    names = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        engines = {n: load(MODES[n], Path(tmp)) for n in names}
        dtype = dtype_name(next(iter(engines.values())).loaded.dtype)
        samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        for _ in range(args.rounds):
            for n, engine in engines.items():
                with torch.inference_mode():
                    for r in ROWS:
                        t = decode_step_s(engine, r, 100, args.repeats)
                        samples[n].setdefault(f"decode_{r}_ms", []).append(t * 1e3)
                    samples[n].setdefault("prefill_500_ms", []).append(prefill_s(engine, 500) * 1e3)
    result = {}
    for n in names:
        stat = min if args.stat == "min" else statistics.median
        row = {k: round(stat(v), 1) for k, v in samples[n].items()}
        for r in ROWS:
            row[f"decode_{r}_tokens_per_s"] = round(r * 1e3 / row[f"decode_{r}_ms"], 1)
        result[n] = row
        print(json.dumps({"mode": n, **row}), flush=True)
    base = result.get("bitsandbytes_nf4")
    summary: dict[str, object] = {
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, compute {dtype}"
    }
    if base:
        for n in names:
            for r in ROWS:
                key = f"decode_{r}_ms"
                summary[f"{n}_decode_{r}_vs_bnb"] = round(base[key] / result[n][key], 2)
    after = result.get("int4_default")
    # the default path over the same on PyTorch's int4 kernel, without issue 9's cuts, with the
    # compute-dtype dense copy (before FBGEMM's float16), and through transformers' modules
    # (before the flat forward)
    befores = {
        "own_q4": "torch_int4_kernel",
        "issue9": "torch_int4_unfused",
        "fp16_dense": "torch_int4_dense_above_16",
        "lean_forward": "torch_int4_transformers_forward",
        "decode_path": "int4_layer_loop",
    }
    for label, mode in befores.items():
        before = result.get(mode)
        if before and after:
            for key in [f"decode_{r}_ms" for r in ROWS] + ["prefill_500_ms"]:
                speedup = round(before[key] / after[key], 3)
                summary[f"{label}_{key.removesuffix('_ms')}_speedup"] = speedup
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
