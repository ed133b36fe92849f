"""What the prefix cache saves: a shared system prompt prefilled once for everyone, a
regenerate that recomputes nothing, and long conversations that keep their cache.

1. 16 users, each a new conversation under the same ~1,000-token shared system prompt
   (`--shared-system-prompt`) with a different short first message, one after another:
   `shared_prefix_ttft_ratio` = TTFT p50 of users 2-16 over user 1's (target <= 0.2), and
   `prefix_blocks_ratio` = KV blocks in use after the 16 first turns over (the blocks of one
   prefix + each user's own tail) (target <= 1.05).
2. Regenerate on a ~1,500-token conversation: `regenerate_ttft_ratio` = its TTFT over a cold
   turn of the same length (prefix cache emptied first) (target <= 0.1).
3. A conversation driven to 2x the context over `--long-turns` turns (40 with
   `--max-model-len 2048` does it):
   `long_conversation_prefill_fraction` = mean prompt tokens prefilled per turn over the
   context length (target <= 0.25).

The engine is used directly through a SessionManager (as bench/restore.py does). Prints one
JSON object per part and, last, a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import is_random  # noqa: E402
from bench.restore import history_text  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.loader import dtype_name, load_model  # noqa: E402
from sessions import ChatTurn, SessionConfig, SessionManager  # noqa: E402
from sessions.prompt import conversation  # noqa: E402

FIRST = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
TOPICS = [
    "the tides", "volcanoes", "honey bees", "glaciers", "the printing press", "comets",
    "coral reefs", "the violin", "desert plants", "lighthouses", "owls", "paper money",
    "the compass", "rainbows", "salt", "windmills",
]  # fmt: skip


def ttft(turn: ChatTurn) -> float:
    """Seconds from starting the turn to its first streamed text (the turn is consumed)."""
    t0, first = time.perf_counter(), None
    for _ in turn:
        first = first or time.perf_counter()
    return (first or time.perf_counter()) - t0


def shared_prefix(engine: Engine, sm: SessionManager, users: int) -> dict:
    """Part 1: users one after another under the shared system prompt."""
    times, sids, prompts = [], [], []
    for i in range(users):
        owner = f"user{i}"
        sid = sm.create_session(owner)["id"]
        turn = sm.chat(owner, sid, f"Tell me one fact about {TOPICS[i % len(TOPICS)]}.", FIRST)
        times.append(ttft(turn))
        sids.append(sid)
        prompts.append(turn.prompt)
    stats, bs = engine.stats(), engine.config.block_size
    shared_blocks = sm.prompts.shareable(prompts[0]) // bs
    resident = engine.resident_kv()
    tails = sum(-(-resident[sid][0] // bs) - shared_blocks for sid in sids)
    return {
        "users": users,
        "system_prompt_tokens": sm.prompts.shareable(prompts[0]),
        "user1_ttft_s": round(times[0], 4),
        "users_2_on_ttft_p50_s": round(statistics.median(times[1:]), 4),
        "shared_prefix_ttft_ratio": round(statistics.median(times[1:]) / times[0], 4),
        "kv_blocks_used": stats.blocks_used,
        "blocks_one_prefix_plus_tails": shared_blocks + tails,
        "prefix_blocks_ratio": round(stats.blocks_used / (shared_blocks + tails), 4),
        "blocks_shared": stats.blocks_shared,
    }


def regenerate(engine: Engine, sm: SessionManager, loaded, tokens: int) -> dict:  # noqa: ANN001
    """Part 2: regenerate the last reply of a ~`tokens` conversation vs a cold turn."""
    text = history_text(loaded, tokens - 60)
    reply = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    own = "Answer briefly."  # not the shared prompt: nothing of it is cached for the cold turn
    sid = sm.create_session("regen", system_prompt=own)["id"]
    sm.chat("regen", sid, text, reply).result()
    regen = sm.regenerate("regen", sid, FIRST)
    regen_s = ttft(regen)
    engine.reset_prefix_cache()
    cold_sid = sm.create_session("cold", system_prompt=own)["id"]
    cold = sm.chat("cold", cold_sid, text, FIRST)
    cold_s = ttft(cold)
    assert cold.handle is not None and cold.handle.num_cached_tokens == 0
    return {
        "conversation_tokens": len(regen.prompt),
        "regenerate_ttft_s": round(regen_s, 4),
        "regenerate_cached_tokens": regen.handle.num_cached_tokens if regen.handle else 0,
        "cold_ttft_s": round(cold_s, 4),
        "regenerate_ttft_ratio": round(regen_s / cold_s, 4),
    }


def long_conversation(sm: SessionManager, turns: int, context: int) -> dict:
    """Part 3: a conversation driven past twice the context, prefill per turn."""
    sid = sm.create_session("long", system_prompt="Be brief.")["id"]
    reply = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    prefilled = []
    for i in range(turns):
        turn = sm.chat("long", sid, f"Turn {i}: {TOPICS[i % len(TOPICS)]}, go on. " * 4, reply)
        turn.result()
        prefilled.append(turn.num_prefilled_tokens)
    session = sm.get_session("long", sid)
    # the whole transcript, untruncated (encode would refuse it: it is over the context)
    whole = [
        t
        for piece in sm.prompts.pieces(conversation(session, sm.messages("long", sid)))
        for t in piece
    ]
    return {
        "turns": turns,
        "context_tokens": context,
        "conversation_tokens": len(whole),
        "mean_prefilled_per_turn": round(statistics.mean(prefilled), 1),
        "long_conversation_prefill_fraction": round(statistics.mean(prefilled) / context, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--regenerate-tokens", type=int, default=1500)
    ap.add_argument("--long-turns", type=int, default=0, help="0: skip part 3")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    engine = Engine(config, loaded)
    work = Path(tempfile.mkdtemp(prefix="crowdchat-prefix-"))
    system_file = work / "system.txt"
    system_file.write_text(history_text(loaded, args.system_tokens))
    sessions = SessionConfig(
        idle_seconds=1e9, tokens_per_minute=0, shared_system_prompt=system_file
    )
    sm = SessionManager(engine, sessions, work / "data")
    summary: dict[str, object] = {
        "device": str(loaded.device),
        "quant": config.quant,
        "dtype": dtype_name(loaded.dtype),
        "weights": "random" if is_random(config.model) else "real",
    }
    try:
        warm = sm.create_session("warm", system_prompt="Be brief.")["id"]
        sm.chat("warm", warm, "Hi", FIRST).result()  # first-call costs, nothing shared
        sm.delete_session("warm", warm)
        runs = [
            lambda: shared_prefix(engine, sm, args.users),
            lambda: regenerate(engine, sm, loaded, args.regenerate_tokens),
        ]
        if args.long_turns:
            runs.append(lambda: long_conversation(sm, args.long_turns, engine.max_model_len))
        for run in runs:  # each part printed as soon as it is measured
            part = run()
            print(json.dumps(part), flush=True)
            summary.update({k: v for k, v in part.items() if k.endswith("_ratio")})
            summary.update({k: v for k, v in part.items() if k.endswith("_fraction")})
    finally:
        sm.shutdown()
        engine.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
