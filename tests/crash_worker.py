"""A crowdchat process for the SIGKILL tests: chats or snapshots until the test kills it.

Usage: python -m tests.crash_worker MODEL_DIR DATA_DIR stream|snapshot
Prints READY <session id> and then STREAMING / WRITING lines the parent waits for. In snapshot
mode it first writes the reference the parent checks a disk restore against: the session's K/V
bytes and, from a twin session whose KV never leaves memory, the exact next reply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from engine import Engine, EngineConfig, SamplingParams
from engine.model.loader import load_model
from sessions import SessionConfig, SessionManager

FIRST = "Tell me about the sea. " * 40
NEXT = "Still there?"
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def main() -> None:
    model_dir, data_dir, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    loaded = load_model(EngineConfig(data_dir=model_dir))
    engine = Engine(EngineConfig(data_dir=data_dir, kv_budget_mb=64), loaded)
    sm = SessionManager(engine, SessionConfig(idle_seconds=3600), data_dir)
    sid = sm.create_session("victim")["id"]
    sm.chat("victim", sid, FIRST, SamplingParams(temperature=0, max_new_tokens=32)).result()
    print("READY", sid, flush=True)
    if mode == "stream":
        turn = sm.chat(
            "victim",
            sid,
            "Now a very long story, please.",
            SamplingParams(temperature=0, max_new_tokens=4000, ignore_eos=True),
        )
        for i, _ in enumerate(turn):
            if i == 5:
                print("STREAMING", flush=True)
    else:
        kv = engine.export_kv(sid)
        save_file({"k": kv.k, "v": kv.v}, str(data_dir / "reference.safetensors"))
        twin = sm.create_session("twin")["id"]
        first = sm.chat("twin", twin, FIRST, SamplingParams(temperature=0, max_new_tokens=32))
        reference = {"first": first.result(), "next": sm.chat("twin", twin, NEXT, GREEDY).result()}
        (data_dir / "reference.json").write_text(json.dumps(reference))
        print("WRITING", flush=True)
        while True:
            sm.persist_now(sid)
            sm.offload.restore(sid)


if __name__ == "__main__":
    main()
