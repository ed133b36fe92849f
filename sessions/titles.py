"""A conversation's title from its first message, the moment it is sent.

A heuristic, not the model's own title: the embedded 135M model's titles are poor (it answers
the question instead, or repeats it), and asking any model costs a generation in the shared
batch for every new conversation, after the first reply, so the list would show a placeholder
first. The first message's first line of prose, without greetings, markdown or chat-template
tokens, cut at a word boundary, names the conversation at once; its owner renames it freely."""

from __future__ import annotations

import re
import unicodedata

MAX_CHARS = 48  # one line of the sidebar on a phone; a word that crosses it is left out
READ_CHARS = 4000  # a title needs the start of a message, not all of a 100 kB paste
FENCE = re.compile(r"^\s*(```|~~~).*?(^\s*\1\s*$|\Z)", re.MULTILINE | re.DOTALL)
SPECIAL = re.compile(r"<\|[^|<>]{0,40}\|>|</?s>|\[/?INST\]|<</?SYS>>", re.IGNORECASE)
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
LINE_MARK = re.compile(r"^\s*(#{1,6}\s+|>\s*|[-*+]\s+|\d{1,3}[.)]\s+)+")
EMPHASIS = re.compile(r"(\*{1,3}|_{2,3}|~~|`+)")
GREETING = re.compile(
    r"^((hi|hello|hey|hiya|howdy|greetings|good (morning|afternoon|evening))"
    r"( there| all| everyone| folks)?)(?=[\s,!.:;]|$)[\s,!.:;-]*",
    re.IGNORECASE,
)
ASKING = re.compile(
    r"^(please|pls|kindly|(can|could|would|will) you( please| kindly)?|"
    r"i (want|need|would like) you to|help me( to)?)\b[\s,:]*",
    re.IGNORECASE,
)
BIDI = dict.fromkeys([*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F])


def _visible(text: str) -> str:
    """Control characters (but line breaks) and direction overrides out: a title cannot
    reorder the list it is shown in."""
    text = text.translate(BIDI)
    return "".join(" " if unicodedata.category(c) == "Cc" and c != "\n" else c for c in text)


def _prose(text: str) -> str:
    """The message's first line of prose: code blocks out (unless all it has is code), then
    markdown's marks and links' targets out."""
    without_code = FENCE.sub("\n", text)
    if not without_code.strip():  # only code: its first line says what it is
        without_code = re.sub(r"^\s*(```|~~~)\S*", "", text, flags=re.MULTILINE)
    for line in without_code.splitlines():
        line = LINE_MARK.sub("", LINK.sub(r"\1", line))
        line = " ".join(EMPHASIS.sub("", line).split())
        if line:
            return line
    return ""


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters, cut at the last word boundary, with an ellipsis."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    if space >= limit // 2:  # else one long word (a URL, CJK without spaces): cut inside it
        head = head[:space]
    return head.rstrip(" ,;:-") + "…"


def title_from(message: str, limit: int = MAX_CHARS) -> str:
    """A short title for a conversation that starts with `message` ("" if nothing in it
    reads as words: the next message names it)."""
    text = SPECIAL.sub(" ", _visible(message[:READ_CHARS]))
    line = _prose(text)
    asked = ASKING.sub("", GREETING.sub("", line)).strip()
    if any(c.isalnum() for c in asked):  # else the greeting was all it said: keep it
        line = asked
    return _cut(line[:1].upper() + line[1:], limit)
