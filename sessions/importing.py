"""Conversations brought in from a file: crowdchat's own export (`sessions.export`) or ChatGPT's
`conversations.json`. The whole file is read and checked before anything is written, so a bad
file imports nothing (the store then writes every conversation in one transaction).

ChatGPT's export is a list of conversations, each a `mapping` of nodes (`parent`, `children`,
`message`) and a `current_node`. Its user and assistant messages of text become the tree
crowdchat keeps (sibling replies and edits stay branches; the path to `current_node` is the one
shown); tool calls and their output, hidden messages, images and custom instructions are left
out (and counted); the first visible system message becomes the system prompt.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from engine import InvalidRequest
from engine.sequence import FinishReason
from sessions.chat_settings import ChatSettings
from sessions.export import FORMAT, VERSION
from sessions.prompt import CONTROL

MAX_MESSAGES = 100_000  # in one file, all conversations together
ROLES = ("user", "assistant")
CHATGPT_ROLES = ("system", "user", "assistant", "tool")
CHATGPT_FINISH = {"stop": "stop", "max_tokens": "length", "interrupted": "cancelled"}


@dataclass
class Message:
    """One message to write; `parent` is the index of an earlier message of its conversation."""

    parent: int | None
    role: str
    content: str
    created: float
    finish_reason: str | None = None
    selected: bool = True


@dataclass
class Conversation:
    """One conversation to write, its messages parents first."""

    title: str
    created: float
    last_active: float
    system_prompt: str = ""
    settings: str | None = None  # JSON (sessions.chat_settings)
    messages: list[Message] = field(default_factory=list)


@dataclass
class Parsed:
    """What a file holds, and what of it was left out (ChatGPT's tool messages, images)."""

    conversations: list[Conversation]
    skipped: int = 0


class _Reader:
    """Checks what it reads against the limits, naming where a problem is."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.messages = 0
        self.now = time.time()

    def text(self, value: object, where: str, limit: int | None = None) -> str:
        if not isinstance(value, str):
            raise InvalidRequest(f"{where} must be text")
        limit = limit or self.max_chars
        if len(value) > limit:
            raise InvalidRequest(f"{where} is {len(value):,} characters; the limit is {limit:,}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{where} is not valid UTF-8 text") from None
        return CONTROL.sub("", value)

    def when(self, value: object, where: str) -> float:
        if value is None:
            return self.now
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not 0 <= value < 1e11:  # type: ignore[operator]
            raise InvalidRequest(f"{where} must be a time in seconds since 1970")
        return float(value)  # type: ignore[arg-type]

    def count(self, n: int) -> None:
        self.messages += n
        if self.messages > MAX_MESSAGES:
            raise InvalidRequest(f"the file holds over {MAX_MESSAGES:,} messages; import less")


def parse_import(data: bytes, max_bytes: int, max_chars: int) -> Parsed:
    """The conversations of an export file, checked whole; InvalidRequest saying what is wrong
    (and where) for anything else: not JSON, another shape, too large, a message over
    `max_chars`, an unknown role."""
    if len(data) > max_bytes:
        raise InvalidRequest(
            f"the file is {len(data) / 1e6:.1f} MB; the limit is {max_bytes / 1e6:.1f} MB"
        )
    try:
        body = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidRequest("the file is not UTF-8 text (an export file is JSON)") from None
    except RecursionError:
        raise InvalidRequest("the file is JSON nested too deep to be an export") from None
    except ValueError:
        raise InvalidRequest("the file is not JSON (an export file is JSON)") from None
    reader = _Reader(max_chars)
    if isinstance(body, dict) and body.get("format") == FORMAT:
        return Parsed(_crowdchat(body, reader))
    if isinstance(body, dict) and "mapping" in body:
        body = [body]  # one ChatGPT conversation
    if isinstance(body, list) and all(isinstance(c, dict) and "mapping" in c for c in body):
        return _chatgpt(body, reader)
    raise InvalidRequest("the file is neither a crowdchat export nor ChatGPT's conversations.json")


# -- crowdchat's own export ---------------------------------------------------------------


def _crowdchat(body: dict, reader: _Reader) -> list[Conversation]:
    version = body.get("version")
    if version != VERSION:
        raise InvalidRequest(
            f"the file is a crowdchat export of version {version!r}; this server reads {VERSION}"
        )
    items = body.get("conversations")
    if not isinstance(items, list):
        raise InvalidRequest("the file's 'conversations' must be a list")
    return [_conversation(c, f"conversation {i}", reader) for i, c in enumerate(items, 1)]


def _conversation(c: object, where: str, reader: _Reader) -> Conversation:
    if not isinstance(c, dict):
        raise InvalidRequest(f"{where} must be an object")
    settings = c.get("settings")
    try:
        chosen = None if settings is None else ChatSettings.from_dict(settings).to_json()
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}: {e}") from None
    items = c.get("messages", [])
    if not isinstance(items, list):
        raise InvalidRequest(f"{where}: 'messages' must be a list")
    reader.count(len(items))
    created = reader.when(c.get("created"), f"{where}: 'created'")
    convo = Conversation(
        title=reader.text(c.get("title") or "", f"{where}: the title", 200),
        created=created,
        last_active=reader.when(c.get("last_active", created), f"{where}: 'last_active'"),
        system_prompt=reader.text(c.get("system_prompt") or "", f"{where}: the system prompt"),
        settings=chosen,
    )
    index: dict[object, int] = {}
    for i, m in enumerate(items, 1):
        place = f"{where}, message {i}"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{place} must be an object")
        if m.get("role") not in ROLES:
            raise InvalidRequest(f"{place}: unknown role {m.get('role')!r}"[:200])
        parent = m.get("parent")
        if parent is not None and (not _number(parent) or parent not in index):
            raise InvalidRequest(f"{place}: its parent must be an earlier message of the file")
        finish = m.get("finish_reason")
        if finish is not None and (not isinstance(finish, str) or finish not in set(FinishReason)):
            raise InvalidRequest(f"{place}: unknown finish_reason {finish!r}"[:200])
        if not _number(m.get("id")) or m["id"] in index:
            raise InvalidRequest(f"{place}: 'id' must be a number of its own")
        index[m["id"]] = len(convo.messages)
        convo.messages.append(
            Message(
                parent=None if parent is None else index[parent],
                role=m["role"],
                content=reader.text(m.get("content"), f"{place}'s content"),
                created=reader.when(m.get("created"), f"{place}: 'created'"),
                finish_reason=finish,
                selected=m.get("selected", True) is not False,
            )
        )
    _one_selected(convo.messages)
    return convo


def _number(value: object) -> bool:
    """An integer id (JSON's true and false are no ids, though Python counts them ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _one_selected(messages: list[Message]) -> None:
    """Each group of siblings shows exactly one: the last marked selected, else the last."""
    groups: dict[int | None, list[Message]] = {}
    for m in messages:
        groups.setdefault(m.parent, []).append(m)
    for group in groups.values():
        pick = next((m for m in reversed(group) if m.selected), group[-1])
        for m in group:
            m.selected = m is pick


# -- ChatGPT's conversations.json ---------------------------------------------------------


def _chatgpt(items: list[dict], reader: _Reader) -> Parsed:
    parsed = Parsed([])
    for i, c in enumerate(items, 1):
        where = f"conversation {i}"
        mapping = c.get("mapping")
        if not isinstance(mapping, dict) or not all(isinstance(n, dict) for n in mapping.values()):
            raise InvalidRequest(f"{where}: 'mapping' must be an object of message nodes")
        reader.count(len(mapping))
        _check_links(mapping, where)
        created = reader.when(c.get("create_time"), f"{where}: 'create_time'")
        convo = Conversation(
            title=reader.text(c.get("title") or "", f"{where}: the title", 200),
            created=created,
            last_active=reader.when(c.get("update_time") or created, f"{where}: 'update_time'"),
        )
        parsed.skipped += _chatgpt_tree(mapping, c.get("current_node"), convo, where, reader)
        parsed.conversations.append(convo)
    return parsed


def _check_links(mapping: dict, where: str) -> None:
    """Every node's `parent` is a node id (text) or null and its `children` a list of them,
    before anything follows the links (a list there is no key to look up)."""
    for key, node in mapping.items():
        place = f"{where}, node {key!r}"[:120]
        parent = node.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise InvalidRequest(f"{place}: 'parent' must be a node id (text) or null")
        children = node.get("children")
        if children is not None and (
            not isinstance(children, list) or not all(isinstance(k, str) for k in children)
        ):
            raise InvalidRequest(f"{place}: 'children' must be a list of node ids (text)")


def _metadata(message: dict) -> dict:
    metadata = message.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _chatgpt_text(message: dict, where: str, reader: _Reader) -> tuple[str, str] | None:
    """(role, text) of a message crowdchat keeps; None for one it leaves out."""
    author = message.get("author")
    role = author.get("role") if isinstance(author, dict) else None
    if role not in CHATGPT_ROLES:
        raise InvalidRequest(f"{where}: unknown role {role!r}"[:200])
    content = message.get("content")
    if (
        role == "tool"
        or not isinstance(content, dict)
        or content.get("content_type") not in ("text", "multimodal_text")
        or message.get("recipient", "all") != "all"
        or _metadata(message).get("is_visually_hidden_from_conversation")
    ):
        return None
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise InvalidRequest(f"{where}: 'content.parts' must be a list")
    text = "\n".join(p for p in parts if isinstance(p, str))  # images and files are left out
    text = reader.text(text, f"{where}'s text")
    return (role, text) if text.strip() else None


def _chatgpt_tree(
    mapping: dict, current: object, convo: Conversation, where: str, reader: _Reader
) -> int:
    """Fill `convo` from the nodes (parents first); returns how many messages were left out."""
    shown: set[str] = set()
    node = current if isinstance(current, str) else None
    while node in mapping and node not in shown:  # the path to the current node is shown
        shown.add(node)
        node = mapping[node].get("parent")
    roots = [k for k, n in mapping.items() if n.get("parent") not in mapping]
    stack: list[tuple[str, int | None]] = [(k, None) for k in reversed(roots)]
    seen: set[str] = set()
    skipped = 0
    while stack:
        key, parent = stack.pop()
        if key in seen:
            raise InvalidRequest(f"{where}: its message nodes form a loop")
        seen.add(key)
        node = mapping[key]
        place = f"{where}, node {key!r}"[:120]
        message = node.get("message")
        kept = _chatgpt_text(message, place, reader) if isinstance(message, dict) else None
        if kept is not None and kept[0] == "system":
            convo.system_prompt = convo.system_prompt or kept[1]
            kept = None
        elif kept is None and isinstance(message, dict):
            skipped += message["author"]["role"] != "system"  # a tool's, or not text
        if kept is not None:
            assert isinstance(message, dict)
            finish = _metadata(message).get("finish_details")
            kind = finish.get("type") if isinstance(finish, dict) else "stop"
            if not isinstance(kind, str):
                raise InvalidRequest(f"{place}: 'finish_details.type' must be text")
            convo.messages.append(
                Message(
                    parent=parent,
                    role=kept[0],
                    content=kept[1],
                    created=reader.when(message.get("create_time"), f"{place}: 'create_time'"),
                    finish_reason=CHATGPT_FINISH.get(kind, "stop") if kept[0] != "user" else None,
                    selected=key in shown,
                )
            )
            parent = len(convo.messages) - 1
        children = node.get("children") or []
        stack += [(k, parent) for k in reversed(children) if k in mapping]
    if len(seen) < len(mapping):
        raise InvalidRequest(f"{where}: its message nodes form a loop")
    _one_selected(convo.messages)
    return skipped
