"""What the page shows beside each message of the chat: its version among its siblings
(‹ n/m ›) and, under a reply, how it streamed. The value of the message actions component
(ui.message_actions), which draws it onto the chat's messages."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

KEPT_STATS = 10_000  # replies whose speed the page remembers (a few MB at most)


def tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


@dataclass(frozen=True)
class ReplyStats:
    """How a reply streamed, as this server saw it: for the line under the reply."""

    tokens: int
    first_token_s: float
    tokens_per_s: float | None

    def text(self) -> str:
        speed = f" · {self.tokens_per_s:.1f} tokens/s" if self.tokens_per_s else ""
        return f"{tokens(self.tokens)}{speed} · first token in {self.first_token_s:.2f} s"


class StatsMemory:
    """The last KEPT_STATS replies' stats by message id (a reply streamed before a restart
    shows its token count alone, which the store keeps)."""

    def __init__(self, size: int = KEPT_STATS) -> None:
        self.size = size
        self.kept: OrderedDict[int, ReplyStats] = OrderedDict()

    def put(self, message_id: int, stats: ReplyStats) -> None:
        self.kept[message_id] = stats
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def get(self, message_id: int) -> ReplyStats | None:
        return self.kept.get(message_id)


def meta_of(path: list[dict], stats: StatsMemory) -> dict:
    """One entry per message of `path` (the stored rows of the active path, in chat order):
    its role, branch and branches, and a reply's stats (its token count alone for a reply
    this server did not stream since it started)."""
    items = []
    for m in path:
        line = ""
        if m["role"] == "assistant":
            kept = stats.get(m["id"])
            line = kept.text() if kept else (tokens(m["token_count"]) if m["token_count"] else "")
        items.append(
            {"role": m["role"], "branch": m["branch"], "branches": m["branches"], "stats": line}
        )
    return {"items": items}
