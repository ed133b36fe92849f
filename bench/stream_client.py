"""What a bench user sends and reads: its headers (a client of its own), a streamed chat request
of an exact length, and its reply's tokens and text."""

from __future__ import annotations

import hashlib
import json


def client_address(name: str) -> str:
    """An address of client `name`'s own, in 198.18.0.0/15 (RFC 2544's range for benchmarks)."""
    n = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")
    return f"198.18.{n >> 8}.{n & 255}"


def client_headers(key: str) -> dict[str, str]:
    """Bench user `key`'s headers: its bearer, and its `client_address` as a proxy would
    forward it. In crowdchat's open API a client is its address, and the bench's users stand
    for different clients: a crowdchat started with PROXY_ARGS (as `Server` and peers.py start
    it) believes the header; other servers ignore it."""
    return {"Authorization": f"Bearer {key}", "X-Forwarded-For": client_address(key)}


class ReplyCount:
    """One streamed reply's tokens and text: the usage chunk's count when the server sends one,
    else one token per content chunk (the servers loaded here stream a token per chunk)."""

    def __init__(self) -> None:
        self.usage: int | None = None
        self.chunks = 0
        self.parts: list[str] = []
        self.failed = False

    def feed(self, line: str) -> bool:
        """Take one SSE line; True when it carried reply text."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return False
        event = json.loads(line[6:])
        if "error" in event:
            self.failed = True
            return False
        if event.get("usage"):
            self.usage = event["usage"]["completion_tokens"]
        content = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
        if content:
            self.chunks += 1
            self.parts.append(content)
        return bool(content)

    @property
    def tokens(self) -> int:
        return self.chunks if self.usage is None else self.usage

    @property
    def text(self) -> str:
        return "".join(self.parts)


def stream_body(messages: list[dict[str, str]], new_tokens: int) -> dict:
    """A streamed chat request of exactly `new_tokens` tokens (EOS ignored), usage included."""
    return {
        "messages": messages,
        "stream": True,
        "max_tokens": new_tokens,
        "min_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream_options": {"include_usage": True},
    }
