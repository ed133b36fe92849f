"""What a returning user pays: next-turn TTFT with the KV resident, restored from disk, or
recomputed from the transcript (cold), for histories of ~500, ~1000 and ~2000 tokens.

Snapshot files are evicted from the page cache (posix_fadvise) before each restore, so
"disk" means disk, and always read (the session layer would skip a snapshot slower to read
than to recompute: each row says which it would choose now, from the engine's measured
paces). Prints one JSON object per history length and, last, a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import is_random  # noqa: E402
from bench.throughput import TEXT  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from sessions import SessionConfig, SessionManager  # noqa: E402
from sessions.offload import recompute_is_faster  # noqa: E402

NEXT = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


def history_text(loaded, tokens: int) -> str:  # noqa: ANN001
    ids = loaded.tokenizer.encode(TEXT * (tokens // 150 + 2), add_special_tokens=False)
    return loaded.tokenizer.decode(ids[:tokens])


def evict_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ttft(sm: SessionManager, owner: str, sid: str) -> tuple[float, str]:
    """Seconds from sending the next message to its first streamed text."""
    t0 = time.perf_counter()
    turn = sm.chat(owner, sid, "Summarize that in one line.", NEXT)
    first = None
    for _ in turn:
        first = first or time.perf_counter()
    return (first or time.perf_counter()) - t0, turn.restored_from or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--lengths", default="500,1000,2000")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    engine = Engine(config, loaded)
    work = Path(tempfile.mkdtemp(prefix="crowdchat-restore-"))
    sm = SessionManager(engine, SessionConfig(idle_seconds=1e9, tokens_per_minute=0), work)
    sm.offload.weigh_recompute = False  # time every tier; the rows say what it would choose
    summary: dict[str, float | str] = {
        "device": str(loaded.device),
        "quant": config.quant,
        "weights": "random" if is_random(config.model) else "real",
    }
    try:
        sm.chat("bench", sm.create_session("bench")["id"], "Hi", NEXT).result()  # warm-up
        for n in [int(x) for x in args.lengths.split(",")]:
            text = history_text(loaded, n - 40)
            times: dict[str, list[float]] = {"resident": [], "restore": [], "recompute": []}
            load_s, snap_bytes, tokens = [], 0, 0
            for _ in range(args.repeats):
                # one owner per mode: the prefix cache is per owner, so the recomputed
                # session cannot borrow the blocks the resident one holds
                owners = {m: f"bench-{m}" for m in times}
                sids = {m: sm.create_session(owners[m])["id"] for m in times}
                for m, sid in sids.items():
                    sm.chat(
                        owners[m], sid, text, SamplingParams(temperature=0, max_new_tokens=16)
                    ).result()
                tokens = engine.resident_kv()[sids["resident"]][0]
                assert sm.persist_now(sids["restore"])
                path = sm.files.path(sids["restore"])
                snap_bytes = path.stat().st_size
                sm.drop_kv(sids["recompute"])
                engine.reset_prefix_cache()  # a recompute computes, a restore reads the file
                # the restore alone, then the full next turn from a freshly evicted file
                evict_page_cache(path)
                t0 = time.perf_counter()
                assert sm.offload.restore(sids["restore"]) == "disk"
                load_s.append(time.perf_counter() - t0)
                assert sm.persist_now(sids["restore"])
                engine.reset_prefix_cache()
                evict_page_cache(path)
                for mode, sid in sids.items():
                    seconds, origin = ttft(sm, owners[mode], sid)
                    expected = {"resident": "resident", "restore": "disk", "recompute": "cold"}
                    assert origin == expected[mode], (mode, origin)
                    times[mode].append(seconds)
                for m, sid in sids.items():
                    sm.delete_session(owners[m], sid)
            med = {m: statistics.median(v) for m, v in times.items()}
            read, recompute = engine.read_s(snap_bytes), engine.recompute_s(tokens)
            row = {
                "history_tokens": tokens,
                **{f"{m}_ttft_s": round(v, 4) for m, v in med.items()},
                "restore_over_recompute": round(med["restore"] / med["recompute"], 4),
                "snapshot_bytes_per_token": round(snap_bytes / tokens, 1),
                "restore_mb_per_s": round(snap_bytes / 2**20 / statistics.median(load_s), 1),
                # the engine's own predictions, which the session layer chooses by
                "predicted_read_s": read and round(read, 4),
                "predicted_recompute_s": recompute and round(recompute, 4),
                "chooses": "recompute" if recompute_is_faster(read, recompute) else "disk",
            }
            print(json.dumps(row), flush=True)
            for key in (
                "resident_ttft_s",
                "restore_ttft_s",
                "recompute_ttft_s",
                "restore_over_recompute",
                "snapshot_bytes_per_token",
                "restore_mb_per_s",
                "predicted_read_s",
                "predicted_recompute_s",
                "chooses",
            ):
                summary[f"{key}_{n}"] = row[key]
    finally:
        sm.shutdown()
        engine.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
