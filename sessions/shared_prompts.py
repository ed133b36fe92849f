"""System prompts the operator marked shared on the admin page: kept in SQLite (a restart keeps
them), and handed to the prompt encoder, whose shared heads decide which leading blocks any
user may share. Removing one stops the sharing for new turns at once; nothing else changes."""

from __future__ import annotations

import threading
import time

from engine import InvalidRequest
from sessions.prompt import PromptEncoder, clean_text
from sessions.store import Store


class SharedPrompts:
    """The operator's shared system prompts: `--shared-system-prompt` (fixed) plus the admin
    page's list (`add`, `remove`)."""

    def __init__(self, store: Store, prompts: PromptEncoder, fixed: str, limit: int) -> None:
        self.store = store
        self.prompts = prompts
        self.fixed = fixed
        self.limit = limit
        self._lock = threading.Lock()
        self._apply()

    def list(self) -> list[dict]:
        """The admin page's shared prompts (id, text, created), oldest first."""
        reader = self.store.sql.reader()
        return [dict(r) for r in reader.query("SELECT * FROM shared_prompts ORDER BY id")]

    def add(self, text: str) -> dict:
        """Mark `text` shared: conversations whose system prompt it is share its KV blocks
        with every user from their next turn on. Returns its row (the existing one if it
        was already shared)."""
        text = clean_text(text, self.limit).strip()
        if not text:
            raise InvalidRequest("the system prompt is empty")

        def write(db) -> None:  # noqa: ANN001 - a sqlite_utils Database on the writer
            db.execute(
                "INSERT INTO shared_prompts (text, created) VALUES (?, ?)"
                " ON CONFLICT (text) DO NOTHING",
                [text, time.time()],
            )

        self.store.sql.write(write)
        self._apply()
        return next(row for row in self.list() if row["text"] == text)

    def remove(self, prompt_id: int) -> bool:
        """Stop sharing the prompt `prompt_id`; False if there is none."""
        sql = "DELETE FROM shared_prompts WHERE id = ?"
        removed = self.store.sql.write(lambda db: db.execute(sql, [prompt_id]).rowcount)
        self._apply()
        return bool(removed)

    def _apply(self) -> None:
        with self._lock:  # two admins at once: the last list read wins, whole
            texts = [self.fixed] if self.fixed else []
            self.prompts.share(tuple(texts + [row["text"] for row in self.list()]))
