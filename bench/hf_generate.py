"""transformers' own generation on crowdchat's model and prompts: the baselines a GPU run
compares against (issue 35), measured in the same run as bench/throughput.py.

- `static`: `generate` on one left-padded batch with a static cache (`cache_implementation=
  "static"`), which transformers compiles by itself where it does (CUDA). A first full run
  compiles and warms up (its seconds reported as `warmup_s`); the second is timed.
- `continuous`: `generate_batch`, transformers' continuous batching (paged cache), where this
  transformers has it; warmed up the same way.

The model is loaded as the server loads it (engine.model.loader: nf4 through bitsandbytes on
CUDA), the prompts are bench/throughput.py's. Each baseline that fails prints its error and
the others still run. Prints one JSON object per baseline, then a summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import is_random  # noqa: E402
from bench.throughput import make_prompts  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.model.loader import LoadedModel, dtype_name, load_model  # noqa: E402
from engine.threads import run_in_fresh_thread  # noqa: E402

BASELINES = ("static", "continuous")


def sync(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


@torch.inference_mode()
def static_cache(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> int:
    """One `generate` over `prompts`, left-padded, static cache, greedy, EOS ignored: the
    tokens it made."""
    model, tok = loaded.model, loaded.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt").to(loaded.device)
    out = model.generate(
        **batch,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        cache_implementation="static",
    )
    sync(loaded)
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


@torch.inference_mode()
def continuous(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> int:
    """transformers' `generate_batch` over `prompts`, greedy, EOS ignored: the tokens made."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=-1,  # never produced: every request runs its full length
        pad_token_id=loaded.tokenizer.pad_token_id or 0,
    )
    results = loaded.model.generate_batch(inputs=prompts, generation_config=config)
    sync(loaded)
    return sum(len(r.generated_tokens) for r in results.values())


def measure(run: Callable[[LoadedModel, list[list[int]], int], int], loaded: LoadedModel,
            prompts: list[list[int]], new_tokens: int) -> dict[str, object]:  # fmt: skip
    """A warm-up run (compiles what transformers compiles), then a timed one."""
    t0 = time.perf_counter()
    run(loaded, prompts, new_tokens)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = run(loaded, prompts, new_tokens)
    wall = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "warmup_s": round(warmup, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--baselines", default=",".join(BASELINES), help="comma-separated")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    wanted = [b for b in args.baselines.split(",") if b]
    unknown = set(wanted) - set(BASELINES)
    if unknown:
        ap.error(f"unknown baselines {sorted(unknown)}: choose from {BASELINES}")
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    loaded.model.set_attn_implementation("sdpa")  # transformers' own attention, as throughput.py
    prompts = make_prompts(loaded, args.batch, args.prompt_tokens)
    summary: dict[str, object] = {
        "device": str(loaded.device),
        **(
            {"gpu": torch.cuda.get_device_name(loaded.device)}
            if loaded.device.type == "cuda"
            else {}
        ),  # fmt: skip
        "weights": "random" if is_random(config.model) else "real",
        "quant": config.quant,
        "dtype": dtype_name(loaded.dtype),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    runs = {"static": static_cache, "continuous": continuous}
    for name in wanted:
        if name == "continuous" and not hasattr(loaded.model, "generate_batch"):
            row: dict[str, object] = {"error": "this transformers has no generate_batch"}
        else:
            try:  # torch on a thread of its own, as the engine runs it (engine.threads)
                row = run_in_fresh_thread(
                    lambda run=runs[name]: measure(run, loaded, prompts, args.new_tokens)
                )
            except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                row = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps({"baseline": name, **row}), flush=True)
        for key in ("tokens_per_s", "warmup_s", "error"):
            if key in row:
                summary[f"{name}_{key}"] = row[key]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
