"""Full-text search over one user's own conversations: their titles and every message of every
branch, through the SQLite FTS5 tables that migration 008's triggers keep current.

What a user types is never FTS5 syntax: it is cut into words, each searched as a quoted term
(the last one also as a prefix, so a search finds while the word is still being typed), all of
them required. Every query joins the hits to `sessions` and keeps only the owner's.
"""

from __future__ import annotations

import re

from sqlite_utils import Database

from engine import InvalidRequest

MAX_QUERY_CHARS = 200
MAX_TERMS = 16
MAX_RESULTS = 50


def fts_query(text: object) -> str:
    """The FTS5 query for what a user typed; InvalidRequest if it holds no word or is huge."""
    if not isinstance(text, str):
        raise InvalidRequest("a search must be text")
    if len(text) > MAX_QUERY_CHARS:
        raise InvalidRequest(f"a search is at most {MAX_QUERY_CHARS} characters")
    terms = re.findall(r"\w+", text)[:MAX_TERMS]
    if not terms:
        raise InvalidRequest("type a word to search for")
    quoted = [f'"{t}"' for t in terms]  # \w never holds a quote: nothing to escape
    quoted[-1] += "*"
    return " ".join(quoted)


_TITLES = (
    "SELECT s.id, s.title, s.last_active,"
    " snippet(sessions_fts, 0, ?, ?, '…', 12) AS snippet"
    " FROM sessions_fts JOIN sessions s ON s.id = sessions_fts.session_id"
    " WHERE sessions_fts MATCH ? AND s.owner = ? ORDER BY bm25(sessions_fts) LIMIT ?"
)
_MESSAGES = (
    "SELECT s.id, s.title, s.last_active, m.id AS message_id, m.role,"
    " snippet(messages_fts, 0, ?, ?, '…', 12) AS snippet"
    " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid"
    " JOIN sessions s ON s.id = m.session_id"
    " WHERE messages_fts MATCH ? AND s.owner = ? ORDER BY bm25(messages_fts) LIMIT ?"
)


def search(
    db: Database, owner: str, text: object, limit: int = 20, marks: tuple[str, str] = ("**", "**")
) -> list[dict]:
    """`owner`'s conversations that match `text`, best first, one row each: `session_id`,
    `title`, `last_active`, and where it matched: `message_id` and `role` (None for a match in
    the title) and a `snippet` with the matching words between `marks`. A match in the title
    ranks before one in a message."""
    query = fts_query(text)
    limit = max(1, min(int(limit), MAX_RESULTS))
    found: dict[str, dict] = {}
    for sql, per_session in ((_TITLES, 1), (_MESSAGES, 4)):
        rows = db.execute(sql, [*marks, query, owner, limit * per_session]).fetchall()
        for row in rows:
            sid, title, last_active, *where = row
            if sid in found or len(found) >= limit:
                continue
            message_id, role, snippet = where if len(where) == 3 else (None, None, where[0])
            found[sid] = {
                "session_id": sid,
                "title": title,
                "last_active": last_active,
                "message_id": message_id,
                "role": role,
                "snippet": snippet,
            }
    return list(found.values())
