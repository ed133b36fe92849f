"""Users' conversations: transcripts in SQLite, KV that follows the session in and out of the
pool, and owner checks on every call. Uses the engine's public API only."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine import Backend, InvalidRequest, SamplingParams
from engine.chat_format import ChatFormatter
from sessions.admin import SessionFacts, SessionStats, session_facts, session_stats
from sessions.admission import Admission
from sessions.branch_turns import BranchTurns
from sessions.chat_settings import ChatSettings
from sessions.config import SessionConfig
from sessions.errors import SessionNotFound
from sessions.prompt import (
    Message,
    PromptEncoder,
    clean_messages,
    clean_system_prompt,
    clean_text,
    conversation,
    user_says,
)
from sessions.quota import StorageQuota
from sessions.reply import OneOffReply, Reply
from sessions.residency import Residency
from sessions.shared_prompts import SharedPrompts
from sessions.snapshots import SnapshotFiles, check_session_id
from sessions.state import SessionState
from sessions.store import Store
from sessions.titles import title_from
from sessions.transfer import Transfers
from sessions.turn import ChatTurn, TurnPlan
from sessions.turn_life import TurnLife

log = logging.getLogger(__name__)
ADMIN_ROWS = 200  # sessions the admin page lists, most recently active first


class SessionManager(BranchTurns, TurnLife, Transfers):
    """Create, list, rename, delete, export and import an owner's sessions; chat in them;
    answer one-off requests; and move idle sessions' KV to disk and back. Every call checks
    the owner."""

    def __init__(self, engine: Backend, config: SessionConfig, data_dir: Path) -> None:
        self.engine = engine
        self.config = config
        data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(data_dir / "crowdchat.db")
        self.files = SnapshotFiles(data_dir / "snapshots")
        self.default_system = config.shared_system_text()
        self.prompts = PromptEncoder(
            ChatFormatter(engine.tokenizer),
            engine.max_model_len,
            (self.default_system,) if self.default_system else (),
        )
        self.formatter = self.prompts.formatter
        self.shared_prompts = SharedPrompts(
            self.store, self.prompts, self.default_system, config.max_message_chars
        )
        self.admission = Admission(config)
        self.quota = StorageQuota(self.store, config)
        self.limiter = self.admission.limiter
        self._active: dict[str, ChatTurn | None] = {}  # session id -> its running turn
        self._active_lock = threading.Lock()
        self._one_offs: dict[str, set] = {}  # owner -> handles of one-off replies (stop_owner)
        self.residency = Residency(engine, config, self.store, self.files, self._is_busy)
        self.offload = self.residency.offload
        self.offload.cache_key = self._cache_key
        # set by the app (app.build_app): --share-links off refuses new links on every door,
        # and a link whose owner may not sign in now (disabled, removed) reads as gone
        self.share_links = True
        self.owner_active: Callable[[str], bool] = lambda _owner: True

    # -- sessions -----------------------------------------------------------------------
    def create_session(
        self,
        owner: str,
        title: str = "",
        system_prompt: str = "",
        settings: ChatSettings | None = None,
    ) -> dict:
        """A new empty conversation for `owner` with a random 128-bit id (RateLimited at the
        per-user cap on conversations, or while the owner creates too many at once; ServerBusy
        while everyone together does: the writes queue on the one SQLite writer). The system
        prompt is kept without surrounding whitespace, as shared prompts are, so one pasted
        with a trailing newline still matches its shared twin. `settings`: its sampling
        settings (the page sends its sliders, which start from the owner's last choice);
        without, its turns take what each request says (the API's way)."""
        system_prompt = clean_system_prompt(system_prompt, self.config.max_message_chars)
        chosen = None if settings is None else settings.to_json()
        with self.admission.caps.creating(owner, self.store.count_sessions):
            row = self.store.create_session(
                secrets.token_hex(16), owner, title[:200], system_prompt, chosen
            )
        if chosen is not None and self.store.owner_settings(owner) != chosen:
            self.store.put_settings(owner, None, chosen)
        return row

    def list_sessions(self, owner: str) -> list[dict]:
        return self.store.list_sessions(owner)

    def get_session(self, owner: str, sid: str) -> dict:
        """The session if it exists and is `owner`'s; SessionNotFound otherwise (either way:
        nobody learns whether another user's session exists)."""
        try:
            check_session_id(sid)
        except InvalidRequest:
            raise SessionNotFound("no such conversation") from None
        row = self.store.get_session(sid)
        if row is None or row["owner"] != owner:
            raise SessionNotFound("no such conversation")
        return row

    def messages(self, owner: str, sid: str) -> list[dict]:
        self.get_session(owner, sid)
        return self.store.messages(sid)

    def rename_session(self, owner: str, sid: str, title: str) -> None:
        self.get_session(owner, sid)
        self.store.update_session(sid, title=clean_text(title, 200))

    def search(
        self, owner: str, text: str, limit: int = 20, marks: tuple[str, str] = ("**", "**")
    ) -> list[dict]:
        """The owner's conversations whose title or messages (any branch) match `text`, best
        first, each with where it matched (sessions.search). InvalidRequest for a search
        without a word or over 200 characters."""
        return self.store.search(owner, text, limit, marks)

    def usage(self, owner: str, end_user: str | None = None) -> dict[str, int | float | str | None]:
        """Where `owner`, or the end user it names, stands against the per-user limits
        (Admission.usage), and the owner's storage quota, in bytes."""
        usage = self.admission.usage(owner, self.store.count_sessions(owner), end_user)
        return {**usage, "storage_bytes": self.quota.used(owner),
                "max_storage_bytes": self.quota.limit}  # fmt: skip

    def set_system_prompt(self, owner: str, sid: str, system_prompt: str) -> None:
        """Change the session's system prompt (the page sends it with every message, so an
        unchanged one costs no write)."""
        session = self.get_session(owner, sid)
        text = clean_system_prompt(system_prompt, self.config.max_message_chars)
        if text != session["system_prompt"]:
            self.store.update_session(sid, system_prompt=text)

    def settings(self, owner: str, sid: str) -> ChatSettings:
        """The conversation's sampling settings (the owner's last choice for one that has
        none of its own)."""
        return self.stored_settings(owner, sid) or self.last_settings(owner)

    def stored_settings(self, owner: str, sid: str) -> ChatSettings | None:
        """The settings kept with the conversation, None if it has none of its own."""
        return ChatSettings.from_json(self.get_session(owner, sid).get("settings"))

    def last_settings(self, owner: str) -> ChatSettings:
        """The settings `owner` chose last (the defaults before any): a new conversation's."""
        return ChatSettings.from_json(self.store.owner_settings(owner)) or ChatSettings()

    def set_settings(self, owner: str, sid: str | None, settings: ChatSettings) -> None:
        """Keep `settings` with the conversation `sid` (None: no conversation yet) and as the
        owner's last choice; unchanged settings cost no write."""
        text = settings.to_json()
        if sid is not None and self.get_session(owner, sid).get("settings") != text:
            self.store.put_settings(owner, sid, text)
        elif self.store.owner_settings(owner) != text:
            self.store.put_settings(owner, None, text)

    def delete_session(self, owner: str, sid: str) -> None:
        self.get_session(owner, sid)
        self.stop(owner, sid)
        self.offload.discard(sid, deleted=True)  # final: a turn still ending writes nothing
        self.store.delete_session(sid)

    # -- replies ------------------------------------------------------------------------
    def complete(
        self,
        owner: str,
        messages: list[Message],
        params: SamplingParams,
        end_user: str | None = None,
    ) -> Reply:
        """Answer a whole conversation sent at once (no session). Its whole prompt and its
        reply budget are reserved when it is admitted, against `end_user`'s budget where the
        owner names one (Admission); what it did not use comes back when it ends."""
        cap = self.config.max_messages_per_request
        if len(messages) > cap:
            raise InvalidRequest(f"the request has {len(messages)} messages; the limit is {cap}")
        params = self.admission.clamp(params)
        with self.admission.holding(owner, turn=False, end_user=end_user) as ticket:
            cleaned = clean_messages(messages, self.config.max_message_chars)
            ids = self.prompts.encode(cleaned, self.engine.max_model_len)
            self.admission.reserve(ticket, len(ids), params)
            handle = self.engine.submit(  # fair share and prefix cache per identity
                ids,
                params,
                user=owner,
                cache_ns=owner,
                shareable_prefix=self.prompts.shareable(ids),
            )
        with self._active_lock:
            self._one_offs.setdefault(owner, set()).add(handle)
        end = functools.partial(self._end_one_off, ticket=ticket)
        return OneOffReply(handle, self.engine.queue_position, on_end=end)

    def chat(
        self,
        owner: str,
        sid: str,
        text: str,
        params: SamplingParams,
        end_user: str | None = None,
    ) -> ChatTurn:
        """Add the user's message at the end of the active path (committed before anything
        streams) and start the reply (counted against `end_user`'s limits where the owner
        names one; the conversation stays the owner's)."""
        self.get_session(owner, sid)
        text = clean_text(text, self.config.max_message_chars)

        def plan(session: dict, history: list[dict]) -> TurnPlan:
            update = {"state": SessionState.ACTIVE, "last_active": time.time()}
            if not session["title"]:
                update["title"] = title_from(text)
            parent = history[-1]["id"] if history else None
            return TurnPlan(
                [*conversation(session, history, self.default_system), user_says(text)],
                commit=lambda: self.store.add_message(
                    sid, "user", text, parent_id=parent, session_fields=update
                ),
            )

        return self._turn(owner, sid, params, plan, end_user)

    def prefetch(self, owner: str, sid: str) -> None:
        """The user opened this conversation: bring its KV back while they type."""
        self.residency.prefetch(sid, self.get_session(owner, sid)["state"])

    def answering(self, sid: str) -> bool:
        """Whether a reply is being generated in the session now (the page shows Stop)."""
        return sid in self._active

    def stop(self, owner: str, sid: str) -> None:
        """Stop the session's reply; the part already produced is kept."""
        self.get_session(owner, sid)
        turn = self._active.get(sid)
        if turn is not None:
            turn.cancel()

    # -- admin --------------------------------------------------------------------------
    def facts(self, limit: int = ADMIN_ROWS) -> list[SessionFacts]:
        """The `limit` most recently active sessions with their state and memory."""
        return session_facts(self.engine, self.store, self._active, limit)

    def find_sessions(self, prefix: str, limit: int = 2) -> list[str]:
        """Admin: ids of up to `limit` sessions starting with `prefix` (hex)."""
        return self.store.sessions_starting(prefix.strip().lower(), limit)

    def stats(self) -> SessionStats:
        """Counters and totals for the admin page, the monitor and /metrics."""
        return session_stats(self.store, self.residency, self.admission)

    def persist_now(self, sid: str) -> bool:
        """Admin: write the session's KV to disk and free its blocks now."""
        return self.residency.persist_now(sid)

    def drop_kv(self, sid: str) -> None:
        """Admin: forget the session's KV everywhere (its next turn recomputes)."""
        self.residency.drop_kv(sid)

    def admin_delete(self, sid: str) -> None:
        row = self.store.get_session(sid)
        if row is not None:
            self.delete_session(row["owner"], sid)

    def shutdown(self) -> None:
        """Stop the sweeper, write every session's KV to disk, close the database."""
        self.residency.stop_sweeper()
        for turn in list(self._active.values()):  # replies in flight end, and are committed
            if turn is not None:
                turn.cancel()
        deadline = time.monotonic() + 10
        while self._active and time.monotonic() < deadline:
            time.sleep(0.02)
        self.residency.flush()
        self.store.close()

    # -- internals ----------------------------------------------------------------------
    def _cache_key(self, sid: str, token_ids: list[int]) -> tuple[str | None, int]:
        """The prefix-cache namespace (its owner) and shareable prefix of a session's KV."""
        row = self.store.get_session(sid)
        return (row["owner"] if row else None), self.prompts.shareable(token_ids)

    def _is_busy(self, sid: str) -> bool:
        return sid in self._active
