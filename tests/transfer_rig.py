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


def crowdchat_export() -> dict:
    """crowdchat's own export shape: one conversation with settings, a branch and a stop."""
    from sessions.export import FORMAT, VERSION

    def message(i: int, parent: int | None, role: str, text: str, **extra: object) -> dict:
        return {"id": i, "parent": parent, "role": role, "content": text,
                "created": 1_700_000_000.0 + i, "finish_reason": None, "selected": True,
                **extra}  # fmt: skip

    return {
        "format": FORMAT,
        "version": VERSION,
        "exported": 1_700_000_100.0,
        "conversations": [
            {
                "title": "Pears",
                "created": 1_700_000_000.0,
                "last_active": 1_700_000_050.0,
                "system_prompt": "Be brief.",
                "settings": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64},
                "messages": [
                    message(1, None, "user", "Are pears apples?"),
                    message(2, 1, "assistant", "No.", finish_reason="stop", selected=False),
                    message(3, 1, "assistant", "No, a pome.", finish_reason="cancelled"),
                ],
            }
        ],
    }


# one value of every JSON type, and the shapes that broke the readers (a list or an object
# where a scalar was expected)
EVERY_TYPE: tuple[object, ...] = (None, True, False, 0, -1, 1, 2**70, 1.5, -1e300, "", "x",
                                  "root", [], [1], [[1]], ["u1"], {}, {"type": []})  # fmt: skip


def value_paths(doc: object) -> list[tuple]:
    """Every place of a JSON document that holds a value, as the keys that reach it."""
    paths: list[tuple] = []

    def walk(node: object, at: tuple) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)  # type: ignore[arg-type]
        for key, value in list(items):
            paths.append((*at, key))
            if isinstance(value, (dict, list)):
                walk(value, (*at, key))

    walk(doc, ())
    return paths


def replaced(doc: object, path: tuple, value: object) -> object:
    """A deep copy of `doc` with the value at `path` replaced by `value`."""
    import copy

    new = copy.deepcopy(doc)
    node = new
    for key in path[:-1]:
        node = node[key]  # type: ignore[index]
    node[path[-1]] = copy.deepcopy(value)  # type: ignore[index]
    return new
