"""bench/crash_load.py's checks on a hand-made data dir: they find what is lost or orphaned."""

from __future__ import annotations

from pathlib import Path

from sqlite_utils import Database

from bench.crash_checks import Ack, lost_acks, lying_states, read_db, snapshot_mismatch, transcript
from sessions.migrations import migrate


def data_dir(tmp_path: Path) -> Path:
    """Two sessions: `a` (a turn, a regenerated reply, a snapshot with its file) and `b`
    (persisted with no snapshot row; a file without a row, a row without a file, a temp file)."""
    db = Database(tmp_path / "crowdchat.db")
    migrate(db)
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    for sid, state in (("a", "persisted"), ("b", "persisted"), ("c", "cold")):
        db["sessions"].insert(
            {"id": sid, "owner": "api:x", "title": "", "created": 0, "last_active": 0,
             "state": state, "system_prompt": "Be brief." if sid == "a" else ""}
        )  # fmt: skip
    rows = [
        (1, "a", "user", "Hi", None, 1),
        (2, "a", "assistant", "Hello!", 1, 0),
        (3, "a", "assistant", "Hey.", 1, 1),  # the regenerated reply, selected
        (4, "b", "user", "Yo", None, 1),
        (5, "b", "assistant", "Sure:\n", 4, 1),  # the page shows it as "Sure:"
    ]
    for id, sid, role, content, parent, selected in rows:
        db["messages"].insert(
            {"id": id, "session_id": sid, "role": role, "content": content, "created": 0,
             "parent_id": parent, "selected": selected}
        )  # fmt: skip
    for sid in ("a", "c"):
        db["snapshots"].insert(
            {"session_id": sid, "path": str(snaps / f"{sid}.safetensors"), "bytes": 1,
             "tokens": 1, "token_hash": "", "fingerprint": "{}", "created": 0}
        )  # fmt: skip
    (snaps / "a.safetensors").write_bytes(b"x")
    (snaps / "b.safetensors").write_bytes(b"x")
    (snaps / "a.1234.tmp").write_bytes(b"x")
    db.close()
    return tmp_path


def test_every_acknowledged_message_is_found_and_a_missing_one_is_reported(
    tmp_path: Path,
) -> None:
    db = read_db(data_dir(tmp_path) / "crowdchat.db")
    kept = [
        Ack("a", "session"),
        Ack("a", "user", "Hi"),
        Ack("a", "assistant", "Hello!", after="Hi"),  # an unselected branch is still stored
        Ack("b", "user", "Yo"),
        Ack("b", "assistant", "Sure:", after="Yo", shown=True),  # as Gradio's Chatbot shows it
        Ack("b", "assistant", "Sure:\n", after="Yo"),  # over the API, byte for byte
    ]
    assert lost_acks(db, kept) == []
    lost = [
        Ack("gone", "session"),
        Ack("b", "user", "Hi"),  # in another session only
        Ack("b", "assistant", "Hey.", after="Yo"),
        Ack("a", "assistant", "Hey.", after="Hello!"),  # stored, but not after that message
        Ack("b", "assistant", "Sure:", after="Yo"),  # an API reply must match byte for byte
    ]
    assert lost_acks(db, kept + lost) == lost


def test_orphaned_files_rows_temp_files_and_lying_states_are_each_found(tmp_path: Path) -> None:
    data = data_dir(tmp_path)
    db = read_db(data / "crowdchat.db")
    assert snapshot_mismatch(data, db) == {
        "files_without_row": ["b"],
        "rows_without_file": ["c"],
        "temp_files": ["a.1234.tmp"],
    }
    assert lying_states(db) == ["b"]  # persisted, but no snapshot row
    assert transcript(db, "a") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hey."},
    ]
