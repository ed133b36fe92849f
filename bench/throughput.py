"""Throughput of continuous batching vs transformers' generate, measured in the same run.

Users 1, 8, 16, 32 each send one ~100-token prompt for 64 new tokens (EOS ignored), all at
once. Baselines: `generate` one user at a time (sequential) and one static left-padded batch of
32. Prints one JSON object per point and, last, a summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import is_random  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.metrics import Metrics  # noqa: E402
from engine.model.loader import LoadedModel, dtype_name, load_model  # noqa: E402
from engine.threads import run_in_fresh_thread  # noqa: E402

TEXT = (
    "The history of astronomy spans thousands of years, from the earliest observers who "
    "tracked the motions of the Sun, Moon and planets to modern telescopes that map distant "
    "galaxies. Ancient Babylonian astronomers kept careful records of planetary positions, "
    "Greek philosophers proposed geometric models of the heavens, and medieval scholars in "
    "Baghdad, Cairo and Samarkand refined instruments such as the astrolabe. In the sixteenth "
    "century Copernicus placed the Sun at the center, Kepler described elliptical orbits, and "
    "Galileo turned a telescope to the sky, discovering the moons of Jupiter and the phases of "
    "Venus. Newton unified celestial and terrestrial motion with his law of gravitation. Later "
    "centuries brought spectroscopy, photography, radio astronomy and space telescopes, each "
    "opening a new window on the universe and raising new questions about its origin and fate."
)


def make_prompts(loaded: LoadedModel, n: int, length: int) -> list[list[int]]:
    """`n` distinct prompts of exactly `length` tokens (windows over a long text)."""
    ids = loaded.tokenizer.encode(TEXT * 4, add_special_tokens=False)
    return [ids[i * 3 : i * 3 + length] for i in range(n)]


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    engine.metrics = Metrics()  # engine idle between points: a fresh set of samples
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit(p, sp) for p in prompts]
    for h in handles:
        h.result()
    wall = time.perf_counter() - t0
    tokens = sum(h.num_generated_tokens for h in handles)
    m = engine.metrics
    return {
        "users": len(prompts),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": pct(list(m.ttft), 50),
        "ttft_p95_s": pct(list(m.ttft), 95),
        "itl_p50_s": pct(list(m.itl), 50),
        "itl_p95_s": pct(list(m.itl), 95),
        "max_batch": m.max_batch,
    }


@torch.inference_mode()
def run_generate(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """tokens/s of one static left-padded `generate` batch over `prompts`."""
    model, tok = loaded.model, loaded.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt").to(loaded.device)
    t0 = time.perf_counter()
    out = model.generate(
        **batch,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    wall = time.perf_counter() - t0
    assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
    return len(prompts) * new_tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--users", default="1,8,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip transformers' generate baselines (bench/gpu_check.sh runs them in a step of "
        "their own, last)",
    )
    ap.add_argument(
        "--sequential-requests",
        type=int,
        default=4,
        help="requests the sequential baseline runs one by one",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    users = [int(u) for u in args.users.split(",")]
    prompts = make_prompts(loaded, max(users), args.prompt_tokens)

    # baselines first, with transformers' own attention
    def baselines() -> tuple[float, float]:
        loaded.model.set_attn_implementation("sdpa")
        run_generate(loaded, prompts[:2], 4)  # warm-up
        seq_tps = [
            run_generate(loaded, [p], args.new_tokens) for p in prompts[: args.sequential_requests]
        ]
        return float(np.mean(seq_tps)), run_generate(loaded, prompts[:32], args.new_tokens)

    # Same thread treatment as the engine: torch runs on a thread of its own (engine.threads).
    sequential, static = (None, None) if args.no_baselines else run_in_fresh_thread(baselines)
    if sequential is not None and static is not None:
        for name, tps in (("sequential", sequential), ("static_batch_32", static)):
            print(json.dumps({"baseline": f"{name}_generate", "tokens_per_s": round(tps, 2)}))

    t0 = time.perf_counter()
    engine = Engine(config, loaded)
    stats = engine.stats()
    graphs = {  # in every row: whether the figures are graph replays or eager steps
        "cuda_graphs_captured": stats.cuda_graphs,
        "cuda_graphs_mb": round(stats.graph_bytes / 2**20, 1),
        "runs_ahead": stats.runs_ahead,  # step N+1 launched before N's tokens are read
        **({"cuda_graph_error": stats.cuda_graph_error} if stats.cuda_graph_error else {}),
    }
    engine_start_s = round(time.perf_counter() - t0, 2)  # the pool, and capture on CUDA
    try:
        run_engine(engine, prompts[:4], 8)  # warm-up
        points = {}
        for n in users:
            points[n] = run_engine(engine, prompts[:n], args.new_tokens)
            print(json.dumps({"engine": True, **points[n], **graphs}))
    finally:
        engine.shutdown()
    top = points[max(users)]
    summary = {
        "device": str(loaded.device),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        **(
            {"gpu": torch.cuda.get_device_name(loaded.device)}
            if loaded.device.type == "cuda"
            else {}
        ),
        "weights": "random" if is_random(config.model) else "real",
        "quant": config.quant,
        "dtype": dtype_name(loaded.dtype),
        **({"cuda_attention": loaded.cuda_attention} if loaded.device.type == "cuda" else {}),
        **graphs,
        "engine_start_s": engine_start_s,
        "max_model_len": stats.max_model_len,
        **{f"users_{n}_tokens_per_s": p["tokens_per_s"] for n, p in points.items()},
        **(
            {
                "sequential_tokens_per_s": round(sequential, 2),
                "static_batch_32_tokens_per_s": round(static, 2),
                "ratio_vs_sequential": round(top["tokens_per_s"] / sequential, 2),
                "ratio_vs_static_batch": round(top["tokens_per_s"] / static, 3),
            }
            if sequential is not None and static is not None
            else {}
        ),
        f"users_{max(users)}_ttft_p50_s": top["ttft_p50_s"],
        f"users_{max(users)}_itl_p50_s": top["itl_p50_s"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
