"""What the export and import tests bring in: a conversation in ChatGPT's export shape."""

from __future__ import annotations


def chatgpt_conversation() -> dict:
    """ChatGPT's shape: a null root, a hidden system message, a question answered twice
    (regenerated), a tool call with its output, an image part; the current node on the
    first answer's line."""

    def node(key: str, parent: str | None, children: list[str], message: dict | None) -> dict:
        return {"id": key, "parent": parent, "children": children, "message": message}

    def msg(role: str, *parts: object, **extra: object) -> dict:
        return {
            "author": {"role": role},
            "content": {"content_type": "text", "parts": list(parts)},
            "create_time": 1_700_000_000.5,
            **extra,
        }

    hidden = {"is_visually_hidden_from_conversation": True}
    return {
        "title": "Trip to Porto",
        "create_time": 1_700_000_000.0,
        "update_time": 1_700_000_100.0,
        "current_node": "a1b",
        "mapping": {
            "root": node("root", None, ["sys"], None),
            "sys": node("sys", "root", ["u1"], msg("system", "", metadata=hidden)),
            "u1": node("u1", "sys", ["a1", "a2"], msg("user", "Where should I eat in Porto?")),
            "a1": node("a1", "u1", ["t1"], msg("assistant", "Let me look.", recipient="browser")),
            "t1": node("t1", "a1", ["a1b"], msg("tool", "results...")),
            "a1b": node("a1b", "t1", [], msg("assistant", "Try a francesinha.", {"img": 1})),
            "a2": node("a2", "u1", [], msg("assistant", "Cafe Santiago.")),
        },
    }
