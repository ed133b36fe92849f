"""Fuzz the conversation import (sessions/importing.py) structure-aware: a valid crowdchat
export or ChatGPT conversations.json with values replaced by values of every JSON type (null,
booleans, numbers, text, node ids, lists, objects, copies of other parts of the document),
several at a time, as `POST /v1/sessions/import` and the chat page's upload read it.

A file becomes conversations or an `InvalidRequest` naming where it is wrong (a 400); anything
else (a TypeError from a list where an id was expected, a KeyError...) would be a 500 and is a
finding. Raw bytes are fuzzed too (the first byte picks), for what is not JSON at all.
"""

from __future__ import annotations

import copy
import json

import _harness
import atheris

from engine.errors import InvalidRequest

with atheris.instrument_imports(include=["sessions.importing", "sessions.chat_settings"]):
    from sessions.importing import parse_import

from tests.transfer_rig import (
    EVERY_TYPE,
    chatgpt_conversation,
    crowdchat_export,
    replaced,
    value_paths,
)

SEEDS = (crowdchat_export(), [chatgpt_conversation()], chatgpt_conversation())
MAX_BYTES, MAX_CHARS = 1 << 20, 20_000


def a_value(fdp: atheris.FuzzedDataProvider, doc: object, paths: list[tuple]) -> object:
    """A value of any JSON type: one of EVERY_TYPE, a fuzzed scalar, or a copy of a part of
    the document (a node where a node id was expected, a loop of ids)."""
    kind = fdp.ConsumeIntInRange(0, 5)
    if kind == 0:
        return EVERY_TYPE[fdp.ConsumeIntInRange(0, len(EVERY_TYPE) - 1)]
    if kind == 1:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 2:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 10))
    if kind == 3:
        return fdp.ConsumeFloat()
    if kind == 4 and paths:  # a key of the document as a value (node ids)
        return paths[fdp.ConsumeIntInRange(0, len(paths) - 1)][-1]
    node = doc
    for key in paths[fdp.ConsumeIntInRange(0, len(paths) - 1)] if paths else ():
        node = node[key]  # type: ignore[index]
    return copy.deepcopy(node)


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    if data[:1] == b"!":  # raw bytes
        body = data[1:]
    else:
        fdp = atheris.FuzzedDataProvider(data)
        doc: object = SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)]
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            paths = value_paths(doc)
            if not paths:
                break
            path = paths[fdp.ConsumeIntInRange(0, len(paths) - 1)]
            doc = replaced(doc, path, a_value(fdp, doc, paths))
        body = json.dumps(doc).encode()
    try:
        parsed = parse_import(body, MAX_BYTES, MAX_CHARS)
    except InvalidRequest as e:
        assert str(e), "a refusal says what is wrong"
        return
    for convo in parsed.conversations:
        for i, m in enumerate(convo.messages):
            assert m.parent is None or 0 <= m.parent < i, (i, m.parent)
            assert isinstance(m.content, str) and m.role in ("user", "assistant")


if __name__ == "__main__":
    _harness.main("import", test_one_input)
