"""Export and import of conversations (Markdown, crowdchat's JSON, ChatGPT's conversations.json):
round trips keep every branch and setting, bad files import nothing, and nobody reaches
another user's conversations through them."""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import InvalidRequest, SamplingParams
from engine.model.loader import LoadedModel
from sessions.chat_settings import ChatSettings
from sessions.errors import RateLimited
from sessions.importing import parse_import
from tests.conftest import close_sessions, make_sessions
from tests.transfer_rig import (
    EVERY_TYPE,
    chatgpt_conversation,
    crowdchat_export,
    replaced,
    value_paths,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)
MB = 1_000_000


def tree_shape(sm, sid: str) -> list[tuple]:  # noqa: ANN001
    """A conversation's tree without ids: (role, content, parent's index, selected, branch)."""
    rows = sm.store.message_tree(sid)
    index = {r["id"]: i for i, r in enumerate(rows)}
    return [
        (r["role"], r["content"], index.get(r["parent_id"]), r["selected"], r["branch"])
        for r in rows
    ]


def counts(sm) -> tuple[int, int]:  # noqa: ANN001
    db = sqlite3.connect(sm.store.path)
    try:
        return tuple(
            db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("sessions", "messages")
        )  # noqa: S608, E501
    finally:
        db.close()


@pytest.fixture(scope="module")
def sm(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    engine, manager = make_sessions(nf4_model, tmp_path_factory.mktemp("transfer"))
    yield manager
    close_sessions(engine, manager)


def branched(sm, owner: str) -> str:  # noqa: ANN001
    """A conversation with a regenerated reply and an edited message, and settings."""
    settings = ChatSettings(temperature=0.3, top_p=0.8, max_tokens=64, repetition_penalty=1.1)
    sid = sm.create_session(owner, "Plums", "You are terse.", settings)["id"]
    sm.chat(owner, sid, "Tell me about plums.", GREEDY).result()
    sm.regenerate(owner, sid, SamplingParams(temperature=1.0, seed=3, max_new_tokens=6)).result()
    sm.chat(owner, sid, "And damsons?", GREEDY).result()
    last_user = [m for m in sm.messages(owner, sid) if m["role"] == "user"][-1]
    sm.edit(owner, sid, last_user["id"], "And greengages?", GREEDY).result()
    return sid


def test_a_json_export_imports_back_with_every_branch_setting_and_time(sm) -> None:  # noqa: ANN001
    sid = branched(sm, "alice")
    export = sm.export_json("alice", sid)
    data = json.dumps(export).encode()
    ids, skipped = sm.import_file("bob", data)
    assert skipped == 0 and len(ids) == 1
    copy = sm.get_session("bob", ids[0])
    original = sm.get_session("alice", sid)
    for field in ("title", "system_prompt", "created", "last_active", "settings"):
        assert copy[field] == original[field], field
    assert copy["state"] == "cold" and copy["owner"] == "bob"
    assert tree_shape(sm, ids[0]) == tree_shape(sm, sid)
    assert [m["content"] for m in sm.messages("bob", ids[0])] == [
        m["content"] for m in sm.messages("alice", sid)
    ]
    times = [m["created"] for m in sm.store.message_tree(ids[0])]
    assert times == [m["created"] for m in sm.store.message_tree(sid)]
    # the import is a conversation like any other: it continues (recomputed) and is searchable
    sm.chat("bob", ids[0], "Thanks.", GREEDY).result()
    assert sm.search("bob", "greengages")[0]["session_id"] == ids[0]
    # and exporting all of bob's brings it out again, the same
    again = sm.export_json("bob")["conversations"]
    assert [c["title"] for c in again] == ["Plums"]


def test_markdown_shows_the_active_branch_under_each_speaker(sm) -> None:  # noqa: ANN001
    sid = branched(sm, "carol")
    name, text = sm.export_markdown("carol", sid)
    assert name == "Plums.md" and text.startswith("# Plums\n")
    assert "> You are terse." in text
    shown = sm.messages("carol", sid)
    at = 0
    for m in shown:  # every message of the active path, in order, under its speaker
        speaker = "## You" if m["role"] == "user" else "## Assistant"
        at = text.index(f"{speaker}\n\n{m['content']}", at)
    assert "And damsons?" not in text  # the edited-away message is another branch


def test_chatgpt_conversations_json_keeps_branches_and_leaves_out_tools(sm) -> None:  # noqa: ANN001
    data = json.dumps([chatgpt_conversation()]).encode()
    ids, skipped = sm.import_file("dave", data)
    assert skipped == 2  # the tool call and the tool's output
    session = sm.get_session("dave", ids[0])
    assert session["title"] == "Trip to Porto" and session["created"] == 1_700_000_000.0
    assert [(m["role"], m["content"]) for m in sm.messages("dave", ids[0])] == [
        ("user", "Where should I eat in Porto?"),
        ("assistant", "Try a francesinha."),  # the current node's line; the image left out
    ]
    assert sm.messages("dave", ids[0])[1]["branches"] == 2  # the other answer is a branch
    other = [r for r in sm.store.message_tree(ids[0]) if r["content"] == "Cafe Santiago."]
    assert other and other[0]["selected"] == 0
    # one conversation alone (not in a list) is read too
    assert len(sm.import_file("dave", json.dumps(chatgpt_conversation()).encode())[0]) == 1


def bad_files(sm) -> list[tuple[bytes, str]]:  # noqa: ANN001
    ours = sm.export_json("alice")
    convo = ours["conversations"][0]

    def with_message(**change: object) -> bytes:
        message = {**convo["messages"][0], **change}
        return json.dumps({**ours, "conversations": [{**convo, "messages": [message]}]}).encode()

    gpt = chatgpt_conversation()
    gpt_role = json.loads(json.dumps(gpt))
    gpt_role["mapping"]["u1"]["message"]["author"]["role"] = "wizard"
    gpt_loop = json.loads(json.dumps(gpt))
    gpt_loop["mapping"]["root"]["parent"] = "a2"
    gpt_loop["mapping"]["a2"]["children"] = ["root"]
    limit = int(sm.config.max_import_mb * MB)
    return [
        (b"", "not JSON"),
        (b"hello", "not JSON"),
        (b"\xff\xfe{}", "UTF-8"),
        (b"[1, 2, 3]", "neither"),
        (b'{"a": 1}', "neither"),
        (json.dumps({**ours, "version": 2}).encode(), "version 2"),
        (json.dumps({**ours, "conversations": {}}).encode(), "must be a list"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b" " * (100 * MB), f"the limit is {limit / MB:.1f} MB"),
        (with_message(content="x" * (10 * MB)), "characters; the limit"),
        (with_message(role="wizard"), "unknown role 'wizard'"),
        (with_message(role="system"), "unknown role 'system'"),
        (with_message(parent=99), "parent"),
        (with_message(content="\ud800"), "UTF-8"),
        (with_message(created="yesterday"), "time in seconds"),
        (with_message(finish_reason="bored"), "finish_reason"),
        (
            json.dumps(
                {**ours, "conversations": [{**convo, "settings": {"temperature": 9}}]}
            ).encode(),
            "temperature",
        ),  # noqa: E501
        (json.dumps([gpt_role]).encode(), "unknown role 'wizard'"),
        (json.dumps([gpt_loop]).encode(), "loop"),
        (json.dumps({**ours, "conversations": []}).encode(), "no conversation"),
    ]


def test_bad_files_get_a_clear_error_and_import_nothing(sm) -> None:  # noqa: ANN001
    branched(sm, "alice")
    before = counts(sm)
    for data, message in bad_files(sm):
        with pytest.raises(InvalidRequest, match=message):
            sm.import_file("erin", data)
    assert counts(sm) == before and sm.list_sessions("erin") == []


def test_a_file_whose_last_conversation_is_bad_imports_none_of_it(sm) -> None:  # noqa: ANN001
    ours = sm.export_json("alice")
    good = ours["conversations"][0]
    bad = {**good, "messages": [{**good["messages"][0], "role": "robot"}]}
    before = counts(sm)
    with pytest.raises(InvalidRequest, match="conversation 3, message 1: unknown role"):
        sm.import_file("frank", json.dumps({**ours, "conversations": [good, good, bad]}).encode())
    assert counts(sm) == before


def test_seeded_random_damage_never_half_imports(sm) -> None:  # noqa: ANN001
    """Flip, cut and splice bytes of a real export: each result imports whole or not at all."""
    sid = branched(sm, "gina")
    data = json.dumps(sm.export_json("gina", sid)).encode()
    rng = random.Random(11)
    for _ in range(200):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(damaged))
            match rng.randrange(3):
                case 0:
                    damaged[at] = rng.randrange(256)
                case 1:
                    del damaged[at : at + rng.randint(1, 40)]
                case 2:
                    damaged[at:at] = rng.choice([b"{", b"]", b'"', b"null", b"-1", b"\\u0000"])
        before = counts(sm)
        try:
            ids, _ = sm.import_file("hank", bytes(damaged))
        except InvalidRequest:
            assert counts(sm) == before
        else:
            assert counts(sm)[0] == before[0] + len(ids)
    for sid in [s["id"] for s in sm.list_sessions("hank")]:
        sm.delete_session("hank", sid)


def test_an_import_past_the_conversation_cap_imports_nothing(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, max_sessions_per_user=3)
    try:
        sm.create_session("ivy", "one")
        sm.create_session("ivy", "two")
        ours = sm.export_json("ivy")
        with pytest.raises(RateLimited, match="the file holds 2 conversations.*the limit is 3"):
            sm.import_file("ivy", json.dumps(ours).encode())
        assert len(sm.list_sessions("ivy")) == 2
        sm.import_file(
            "ivy", json.dumps({**ours, "conversations": ours["conversations"][:1]}).encode()
        )
        assert len(sm.list_sessions("ivy")) == 3
    finally:
        close_sessions(engine, sm)


def test_concurrent_imports_and_share_copies_never_pass_the_conversation_cap(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    """Issue 57, defect 3: cap 3, six imports of 3 at once (and share copies racing them)."""
    engine, sm = make_sessions(
        nf4_model, tmp_path, max_sessions_per_user=3, max_pending_creates_per_user=100
    )
    try:
        sid = sm.create_session("src", "shared")["id"]
        sm.store.add_message(sid, "user", "hello")
        token = sm.share("src", sid)["token"]
        three = [chatgpt_conversation()] * 3
        start = threading.Barrier(9)
        done: list[str] = []

        def import_three() -> None:
            start.wait()
            with contextlib.suppress(RateLimited):
                sm.import_file("jo", json.dumps(three).encode())
                done.append("import")

        def copy() -> None:
            start.wait()
            with contextlib.suppress(RateLimited):
                sm.copy_share("jo", token)
                done.append("copy")

        threads = [threading.Thread(target=import_three) for _ in range(6)]
        threads += [threading.Thread(target=copy) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(sm.list_sessions("jo")) <= 3
        assert sm.usage("jo")["conversations"] <= 3
        assert done  # the cap let some in
    finally:
        close_sessions(engine, sm)


@pytest.mark.parametrize("shape", ["crowdchat", "chatgpt"])
def test_every_value_of_either_format_replaced_by_every_json_type_is_read_or_refused(
    shape: str,
) -> None:
    """Issue 57, defect 6: a list where an id was expected was a TypeError (a 500); every
    malformed file is an InvalidRequest (a 400) naming where."""
    seed = crowdchat_export() if shape == "crowdchat" else [chatgpt_conversation()]
    assert parse_import(json.dumps(seed).encode(), MB, 10_000).conversations
    refused = 0
    for path in value_paths(seed):
        for value in EVERY_TYPE:
            body = json.dumps(replaced(seed, path, value)).encode()
            try:
                parse_import(body, MB, 10_000)
            except InvalidRequest as e:
                refused += 1
                if path[-1] in ("parent", "children", "finish_reason"):
                    assert "conversation 1" in str(e), (path, value, str(e))
    assert refused > 50
    at = ("conversations", 0, "messages", 1)
    cases = {
        "crowdchat": [
            ((*at, "parent"), "conversation 1, message 2: its parent"),
            ((*at, "finish_reason"), "conversation 1, message 2: unknown finish_reason"),
        ],
        "chatgpt": [
            ((0, "mapping", "u1", "parent"), "conversation 1, node 'u1': 'parent' must be"),
            ((0, "mapping", "u1", "children"), "conversation 1, node 'u1': 'children' must"),
        ],
    }
    for path, where in cases[shape]:
        doc = replaced(seed, path, [[1]])
        with pytest.raises(InvalidRequest, match=where):
            parse_import(json.dumps(doc).encode(), MB, 10_000)


def test_parse_reads_only_within_its_limits() -> None:
    with pytest.raises(InvalidRequest, match="the limit is 0.0 MB"):
        parse_import(b"[]" * 100, max_bytes=10, max_chars=10)
