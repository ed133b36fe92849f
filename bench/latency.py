"""Do long prompts stall the users who are already chatting?

8 users decode steadily; then 4 long prompts (~1500 tokens each) arrive at once. For each
setting (the fixed token budget, then --target-itl-ms) this prints the decoding users'
inter-token gaps while the long prompts are being prefilled, and the long prompts' TTFT.
The last line is a summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import TEXT, make_prompts  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.loader import LoadedModel, load_model  # noqa: E402


def measure(loaded: LoadedModel, config: EngineConfig, long_tokens: int) -> dict:
    engine = Engine(config, loaded)
    try:
        chat = make_prompts(loaded, 8, 100)
        long_ids = loaded.tokenizer.encode(
            TEXT * (long_tokens // 150 + 2), add_special_tokens=False
        )
        longs = [long_ids[i * 7 : i * 7 + long_tokens] for i in range(4)]
        engine.generate(chat[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
        stamps: list[list[float]] = [[] for _ in chat]

        def consume(i: int, handle) -> None:  # noqa: ANN001
            for _ in handle:
                stamps[i].append(time.perf_counter())

        steady = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
        threads = [
            threading.Thread(target=consume, args=(i, engine.submit(p, steady)))
            for i, p in enumerate(chat)
        ]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 10:
            time.sleep(0.01)
        t0 = time.perf_counter()
        burst = [engine.submit(p, SamplingParams(temperature=0, max_new_tokens=8)) for p in longs]
        firsts = []
        for h in burst:
            next(iter(h))
            firsts.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        for h in burst:
            h.result()
        for t in threads:
            t.join()
        gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if t0 <= b <= t1]
        return {
            "target_itl_ms": config.target_itl_ms,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "gap_p50_ms": round(float(np.percentile(gaps, 50)) * 1000, 1),
            "gap_p95_ms": round(float(np.percentile(gaps, 95)) * 1000, 1),
            "gap_max_ms": round(max(gaps) * 1000, 1),
            "long_prompt_ttft_p50_s": round(float(np.median(firsts)), 3),
            "long_prompt_ttft_max_s": round(max(firsts), 3),
            "prefill_window_s": round(t1 - t0, 3),
        }
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--target", type=float, default=100.0, help="the ITL target to compare")
    args = ap.parse_args()
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    fixed = measure(loaded, replace(config, target_itl_ms=None), args.long_tokens)
    print(json.dumps(fixed), flush=True)
    aware = measure(loaded, replace(config, target_itl_ms=args.target), args.long_tokens)
    print(json.dumps(aware), flush=True)
    print(
        json.dumps(
            {
                "fixed_budget_gap_p95_ms": fixed["gap_p95_ms"],
                "fixed_budget_gap_max_ms": fixed["gap_max_ms"],
                "target_itl_ms": args.target,
                "latency_aware_gap_p95_ms": aware["gap_p95_ms"],
                "latency_aware_gap_max_ms": aware["gap_max_ms"],
                "fixed_long_ttft_max_s": fixed["long_prompt_ttft_max_s"],
                "latency_aware_long_ttft_max_s": aware["long_prompt_ttft_max_s"],
            }
        )
    )


if __name__ == "__main__":
    main()
