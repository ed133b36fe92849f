"""SIGKILL in the middle of a reply or a snapshot write: nothing committed is lost, no
half-written snapshot is ever loaded, and a whole one is restored from disk exactly."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import SamplingParams
from engine.model.loader import LoadedModel
from tests.conftest import close_sessions, make_sessions
from tests.crash_worker import GREEDY, NEXT

ROOT = Path(__file__).resolve().parent.parent


def run_until(model_dir: Path, data_dir: Path, mode: str, marker: str) -> str:
    """Start the worker, wait for `marker`, SIGKILL it; return the session id it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_worker", str(model_dir), str(data_dir), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    sid = ""
    try:
        deadline = time.time() + 240
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY"):
                sid = line.split()[1]
            if line.strip() == marker:
                break
            assert time.time() < deadline, "worker too slow"
        if mode == "snapshot":
            time.sleep(random.uniform(0.2, 1.5))  # somewhere inside the write/restore loop
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert sid
    return sid


def test_killed_while_streaming_keeps_every_committed_message(
    nf4_model: LoadedModel, model_dir: Path, tmp_path: Path
) -> None:
    sid = run_until(model_dir, tmp_path, "stream", "STREAMING")
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        msgs = sm.messages("victim", sid)
        assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
        assert msgs[2]["content"] == "Now a very long story, please."
        assert sm.get_session("victim", sid)["state"] == "cold"  # its KV died with it
        turn = sm.chat(
            "victim", sid, "Hello again.", SamplingParams(temperature=0, max_new_tokens=8)
        )
        assert turn.result() and turn.restored_from == "cold"
    finally:
        close_sessions(engine, sm)


def complete_snapshot(data_dir: Path, sid: str) -> bool:
    """Whether the killed worker left a whole snapshot: its SQLite row and the file it names.
    (Read before a SessionManager opens the data dir, which may clean up.)"""
    db = sqlite3.connect(data_dir / "crowdchat.db")
    try:
        row = db.execute("SELECT path FROM snapshots WHERE session_id = ?", [sid]).fetchone()
    finally:
        db.close()
    return row is not None and Path(row[0]).is_file()


@pytest.mark.parametrize("attempt", range(3))
def test_killed_while_writing_snapshots_restores_a_complete_one_exactly(
    attempt: int, nf4_model: LoadedModel, model_dir: Path, tmp_path: Path
) -> None:
    sid = run_until(model_dir, tmp_path, "snapshot", "WRITING")
    reference = load_file(str(tmp_path / "reference.safetensors"))
    expected = json.loads((tmp_path / "reference.json").read_text())
    complete = complete_snapshot(tmp_path, sid)
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        assert not list((tmp_path / "snapshots").glob("*.tmp"))  # swept at start
        got = sm.offload.restore(sid)
        # A whole snapshot must come back from disk; only a torn or unrecorded one recomputes.
        assert got == ("disk" if complete else "cold")
        if got == "disk":
            kv = engine.export_kv(sid)
            assert torch.equal(kv.k.view(torch.int16), reference["k"].view(torch.int16))
            assert torch.equal(kv.v.view(torch.int16), reference["v"].view(torch.int16))
        msgs = sm.messages("victim", sid)
        assert len(msgs) == 2 and msgs[1]["content"] == expected["first"]
        turn = sm.chat("victim", sid, NEXT, GREEDY)
        reply = turn.result()
        assert reply
        if complete:  # the reply its twin gave with the KV never having left memory
            assert turn.restored_from == "resident" and reply == expected["next"]
    finally:
        close_sessions(engine, sm)
