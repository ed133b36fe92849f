"""Conversations in and out of crowdchat: export as Markdown or JSON, import from a file, and
read-only share links (mixed into SessionManager; the formats live in sessions.export and
sessions.importing, the links in sessions.shares)."""

from __future__ import annotations

import time

from engine import InvalidRequest
from sessions.chat_settings import ChatSettings
from sessions.errors import SessionNotFound
from sessions.export import conversation_json, conversation_markdown, export_file, file_name
from sessions.importing import Conversation, Message, parse_import
from sessions.shares import GONE

# an imported message may be longer than one a user types (a long reply of another service)
IMPORTED_CHARS_PER_TYPED = 10
ALL_FILE = "crowdchat-conversations.json"  # the name of an export of all of a user's


class Transfers:
    """Export and import of an owner's conversations; every call checks the owner. A part of
    `SessionManager` (it uses the manager's store, config, `get_session` and settings)."""

    def export_json(self, owner: str, sid: str | None = None) -> dict:
        """The conversation `sid` (None: every one of the owner's) as crowdchat's export file:
        every branch, the settings and the timestamps."""
        return self._export(self._exported(owner, sid))

    def export_json_file(self, owner: str, sid: str | None = None) -> tuple[str, dict]:
        """(file name, `export_json`): the conversation's title, or one name for all."""
        rows = self._exported(owner, sid)
        name = file_name(rows[0]["title"], ".json") if sid else ALL_FILE
        return name, self._export(rows)

    def export_markdown(self, owner: str, sid: str) -> tuple[str, str]:
        """(file name, Markdown) of the conversation's active branch."""
        row = self.get_session(owner, sid)
        text = conversation_markdown(row, self.store.message_tree(sid))
        return file_name(row["title"], ".md"), text

    def import_file(self, owner: str, data: bytes) -> tuple[list[str], int]:
        """Bring in the conversations of an export file (crowdchat's, or ChatGPT's
        conversations.json) as new conversations of `owner`: all of them, or none with
        InvalidRequest saying what is wrong with the file (or that it would take the owner
        past the per-user cap on conversations). Returns their ids and how many messages
        were left out (ChatGPT's tool messages and images)."""
        parsed = parse_import(
            data,
            int(self.config.max_import_mb * 1e6),
            IMPORTED_CHARS_PER_TYPED * self.config.max_message_chars,
        )
        if not parsed.conversations:
            raise InvalidRequest("the file holds no conversation")
        n = len(parsed.conversations)
        size = sum(_text_bytes(c) for c in parsed.conversations)
        with self.admission.caps.creating(owner, self.store.count_sessions, n, "the file holds"):
            self.quota.check(owner, size, "the file")
            ids = self.store.import_conversations(owner, parsed.conversations)
        return ids, parsed.skipped

    # -- share links --------------------------------------------------------------------
    def share(self, owner: str, sid: str) -> dict:
        """A new read-only link to the conversation's active branch as it is now (refused
        with --share-links off, whichever door asks)."""
        if not self.share_links:
            raise InvalidRequest("share links are off on this server (--share-links)")
        session = self.get_session(owner, sid)
        messages = self.store.messages(sid)
        if not any(m["content"] for m in messages):
            raise InvalidRequest("there is nothing to share yet: the conversation is empty")
        self.quota.check(owner, sum(len(m["content"].encode()) for m in messages), "the link")
        return self.store.shares.create(owner, session, messages)

    def shares(self, owner: str, sid: str) -> list[dict]:
        """The owner's live links to the conversation, newest first."""
        self.get_session(owner, sid)
        return self.store.shares.of_session(owner, sid)

    def revoke_share(self, owner: str, token: str) -> None:
        """Take a link back; SessionNotFound unless it is the owner's and live."""
        self.store.shares.revoke(owner, token)

    def read_share(self, token: str) -> dict:
        """What a link shows (anyone holding it may read it; who may hold one is the
        door's business): title, when it was shared, messages. A link whose owner is
        disabled reads as gone (SessionNotFound) until they are enabled again."""
        shared = self.store.shares.read(token)
        if not self.owner_active(shared.pop("owner")):
            raise SessionNotFound(GONE)
        return shared

    def copy_share(self, owner: str, token: str) -> str:
        """The shared conversation as a new conversation of `owner`, to continue; the
        original is not touched. Returns its id."""
        shared = self.read_share(token)
        messages = [
            Message(i - 1 if i else None, m["role"], m["content"], shared["created"])
            for i, m in enumerate(shared["messages"])
        ]
        now = time.time()
        copy = Conversation(shared["title"], now, now, messages=messages)
        with self.admission.caps.creating(owner, self.store.count_sessions, 1, "continuing adds"):
            self.quota.check(owner, _text_bytes(copy), "continuing it")
            return self.store.import_conversations(owner, [copy])[0]

    def _exported(self, owner: str, sid: str | None) -> list[dict]:
        return [self.get_session(owner, sid)] if sid else self.store.list_sessions(owner)

    def _export(self, rows: list[dict]) -> dict:
        return export_file(
            [
                conversation_json(row, self.store.message_tree(row["id"]), self._settings(row))
                for row in rows
            ]
        )

    def _settings(self, row: dict) -> dict | None:
        stored = ChatSettings.from_json(row.get("settings"))
        return None if stored is None else stored.as_dict()


def _text_bytes(convo: Conversation) -> int:
    """What a conversation's messages take of its owner's storage quota."""
    return sum(len(m.content.encode()) for m in convo.messages)
