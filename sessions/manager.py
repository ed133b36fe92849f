"""Users' conversations: transcripts in SQLite, KV that follows the session in and out of the
pool, and owner checks on every call. Uses the engine's public API only."""

from __future__ import annotations

import logging
import secrets
import threading
import time
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path

from engine import Engine, InvalidRequest, PromptTooLong, SamplingParams
from engine.chat_format import ChatFormatter
from engine.errors import SessionBusy, SessionNotFound
from sessions.config import SessionConfig
from sessions.limits import TokenRateLimiter
from sessions.offload import KVOffloader
from sessions.snapshots import SnapshotFiles, check_session_id
from sessions.store import Store
from sessions.turn import ChatTurn

log = logging.getLogger(__name__)
TITLE_CHARS = 60


@dataclass(frozen=True)
class SessionFacts:
    """One row of the admin page's sessions table."""

    id: str
    owner: str
    title: str
    state: str
    tokens: int
    resident_blocks: int
    resident_bytes: int
    snapshot_bytes: int
    idle_s: float


def clean_text(text: object, limit: int) -> str:
    """A user's message as safe text, or InvalidRequest saying what is wrong with it."""
    if not isinstance(text, str):
        raise InvalidRequest("the message must be text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the message is not valid UTF-8 text") from None
    # control characters other than tab and newline carry no meaning in a chat message
    text = "".join(c for c in text if c in "\t\n" or unicodedata.category(c) != "Cc")
    if not text.strip():
        raise InvalidRequest("the message is empty")
    if len(text) > limit:
        raise InvalidRequest(f"the message is {len(text)} characters; the limit is {limit}")
    return text


class SessionManager:
    """Create, list, rename and delete an owner's sessions; chat in them; and move idle
    sessions' KV to disk and back. Every call checks the owner."""

    def __init__(self, engine: Engine, config: SessionConfig, data_dir: Path) -> None:
        self.engine = engine
        self.config = config
        data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(data_dir / "crowdchat.db")
        self.files = SnapshotFiles(data_dir / "snapshots")
        self.formatter = ChatFormatter(engine.tokenizer)
        self.offload = KVOffloader(engine, self.store, self.files,
                                   int(config.kv_host_budget_mb * 2**20),
                                   int(config.kv_disk_budget_mb * 2**20), self._set_state)
        self._active: dict[str, ChatTurn | None] = {}  # session id -> its running turn
        self.recomputes = 0  # turns whose earlier KV was gone and had to be recomputed
        self.limiter = TokenRateLimiter(config.tokens_per_minute)
        self._active_lock = threading.Lock()
        self._recover()
        engine.set_memory_pressure_hook(
            lambda short, protected: self.offload.evict(short, protected, self._is_busy))
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="crowdchat-sweeper",
                                         daemon=True)
        self._sweeper.start()

    # -- sessions -----------------------------------------------------------------------
    def create_session(self, owner: str, title: str = "", system_prompt: str = "") -> dict:
        """A new empty conversation for `owner` with a random 128-bit id."""
        system_prompt = clean_text(system_prompt, self.config.max_message_chars) \
            if system_prompt.strip() else ""
        return self.store.create_session(secrets.token_hex(16), owner, title[:200],
                                         system_prompt)

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

    def set_system_prompt(self, owner: str, sid: str, system_prompt: str) -> None:
        """Change the session's system prompt (the page sends it with every message, so an
        unchanged one costs no write)."""
        session = self.get_session(owner, sid)
        text = clean_text(system_prompt, self.config.max_message_chars) \
            if system_prompt.strip() else ""
        if text != session["system_prompt"]:
            self.store.update_session(sid, system_prompt=text)

    def delete_session(self, owner: str, sid: str) -> None:
        self.get_session(owner, sid)
        self.stop(owner, sid)
        self.offload.discard(sid)
        self.store.delete_session(sid)

    # -- chatting -----------------------------------------------------------------------
    def clean_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """A whole conversation sent at once (the API's one-off requests), checked like
        chat messages: the last must say something, none may be over the length limit."""
        out = []
        for i, m in enumerate(messages):
            last = i == len(messages) - 1
            if m["content"].strip() or last:
                out.append({"role": m["role"],
                            "content": clean_text(m["content"], self.config.max_message_chars)})
        return out

    def limit(self, owner: str, params: SamplingParams) -> SamplingParams:
        """Apply the per-user limits: RateLimited when over budget, the reply length capped."""
        self.limiter.check(owner)
        if params.max_new_tokens > self.config.max_tokens_per_turn:
            params = replace(params, max_new_tokens=self.config.max_tokens_per_turn,
                             min_new_tokens=min(params.min_new_tokens,
                                                self.config.max_tokens_per_turn))
        return params

    def chat(self, owner: str, sid: str, text: str, params: SamplingParams) -> ChatTurn:
        """Add the user's message (committed before anything streams) and start the reply."""
        session = self.get_session(owner, sid)
        text = clean_text(text, self.config.max_message_chars)
        params = self.limit(owner, params)
        history = self.store.messages(sid)
        convo = [*self._conversation(session, history), {"role": "user", "content": text}]
        prompt = self._encode(convo, params)
        release = self._claim(sid)
        try:
            update = {"state": "active", "last_active": time.time()}
            if not session["title"]:
                update["title"] = " ".join(text.split())[:TITLE_CHARS]
            self.store.add_message(sid, "user", text, session_fields=update)
        except BaseException:
            release()
            raise
        return self._start(sid, prompt, params, release, session, marked=True)

    def regenerate(self, owner: str, sid: str, params: SamplingParams) -> ChatTurn:
        """Replace the last reply with a new one."""
        session = self.get_session(owner, sid)
        params = self.limit(owner, params)
        release = self._claim(sid)
        try:
            history = self.store.messages(sid)
            old = history.pop() if history and history[-1]["role"] == "assistant" else None
            if not history or history[-1]["role"] != "user":
                raise InvalidRequest("there is no message to answer again")
            prompt = self._encode(self._conversation(session, history), params)
            if old is not None:  # only once the new reply can start
                self.store.delete_message(old["id"])
        except BaseException:
            release()
            raise
        return self._start(sid, prompt, params, release, session)

    def edit_last(self, owner: str, sid: str, text: str, params: SamplingParams) -> ChatTurn:
        """Replace the last user message (and its reply) and answer it again."""
        session = self.get_session(owner, sid)
        text = clean_text(text, self.config.max_message_chars)
        params = self.limit(owner, params)
        release = self._claim(sid)
        try:
            history = self.store.messages(sid)
            replies = []
            while history and history[-1]["role"] == "assistant":
                replies.append(history.pop())
            if not history:
                raise InvalidRequest("there is no message to edit")
            last = history[-1]
            convo = self._conversation(session, history[:-1])
            prompt = self._encode([*convo, {"role": "user", "content": text}], params)
            for reply in replies:  # only once the edited message is known to fit
                self.store.delete_message(reply["id"])
            self.store.update_message(last["id"], content=text)
        except BaseException:
            release()
            raise
        return self._start(sid, prompt, params, release, session)

    def prefetch(self, owner: str, sid: str) -> None:
        """The user opened this conversation: bring its KV back while they type."""
        if self.get_session(owner, sid)["state"] == "persisted" and not self._is_busy(sid):
            threading.Thread(target=self._prefetch, args=(sid,), daemon=True).start()

    def _prefetch(self, sid: str) -> None:
        try:
            if self.offload.restore(sid) in ("host", "disk"):
                self._set_state(sid, "resident")
        except Exception:  # noqa: BLE001 - a failed prefetch only costs the turn a restore
            log.exception("prefetch of session %s failed", sid)

    def stop(self, owner: str, sid: str) -> None:
        """Stop the session's reply; the part already produced is kept."""
        self.get_session(owner, sid)
        turn = self._active.get(sid)
        if turn is not None:
            turn.cancel()

    # -- admin --------------------------------------------------------------------------
    def facts(self) -> list[SessionFacts]:
        """Every session with its state and memory, most recently active first."""
        resident = self.engine.resident_kv()
        snaps = {r["session_id"]: r["bytes"] for r in self.store.snapshots()}
        per_block = self.engine.kv_bytes_per_token * self.engine.config.block_size
        now = time.time()
        out = []
        for row in self.store.all_sessions():
            blocks = resident.get(row["id"], (0, 0, 0.0))[1]
            out.append(SessionFacts(
                id=row["id"], owner=row["owner"], title=row["title"], state=row["state"],
                tokens=row["token_count"], resident_blocks=blocks,
                resident_bytes=blocks * per_block, snapshot_bytes=snaps.get(row["id"], 0),
                idle_s=0.0 if row["id"] in self._active else now - row["last_active"]))
        return out

    def persist_now(self, sid: str) -> bool:
        """Admin: write the session's KV to disk and free its blocks now."""
        if self._is_busy(sid):
            return False
        return self.offload.persist(sid)

    def drop_kv(self, sid: str) -> None:
        """Admin: forget the session's KV everywhere (its next turn recomputes)."""
        if not self._is_busy(sid):
            self.offload.discard(sid)
            self._set_state(sid, "cold")

    def admin_delete(self, sid: str) -> None:
        row = self.store.get_session(sid)
        if row is not None:
            self.delete_session(row["owner"], sid)

    def shutdown(self) -> None:
        """Stop the sweeper, write every session's KV to disk, close the database."""
        self._stop.set()
        self._sweeper.join()
        for turn in list(self._active.values()):  # replies in flight end, and are committed
            if turn is not None:
                turn.cancel()
        deadline = time.monotonic() + 10
        while self._active and time.monotonic() < deadline:
            time.sleep(0.02)
        self.engine.set_memory_pressure_hook(None)
        self.offload.flush()
        self.store.close()

    # -- internals ----------------------------------------------------------------------
    def _conversation(self, session: dict, history: list[dict]) -> list[dict[str, str]]:
        convo = [{"role": "system", "content": session["system_prompt"]}] \
            if session["system_prompt"] else []
        convo += [{"role": m["role"], "content": m["content"]} for m in history
                  if m["role"] == "user" or m["content"]]
        return convo

    def _encode(self, convo: list[dict[str, str]], params: SamplingParams) -> list[int]:
        """Token ids of the conversation; the oldest turns give way when it outgrows the
        context (the system prompt and the newest message always stay)."""
        budget = self.engine.max_model_len - min(params.max_new_tokens, 256)
        system = convo[:1] if convo and convo[0]["role"] == "system" else []
        turns = convo[len(system):]
        while True:
            ids = self.formatter.encode(system + turns)
            if len(ids) <= budget:
                return ids
            if len(turns) <= 1:
                raise PromptTooLong(f"the message is {len(ids)} tokens long; this server's "
                                    f"context holds {budget} (shorten it)")
            turns = turns[2:] if len(turns) > 2 else turns[1:]

    def _claim(self, sid: str):  # noqa: ANN202 - returns the release function
        """Mark the session as answering; SessionBusy if it already is."""
        with self._active_lock:
            if sid in self._active:
                raise SessionBusy("this conversation is still answering; wait or press Stop")
            self._active[sid] = None

        def release() -> None:
            with self._active_lock:
                self._active.pop(sid, None)
        return release

    def _start(self, sid: str, prompt: list[int], params: SamplingParams, release,  # noqa: ANN001
               session: dict, marked: bool = False) -> ChatTurn:
        turn = ChatTurn(self, sid, prompt, params, release)
        turn.owner, turn.prior_tokens = session["owner"], session["token_count"]
        turn.had_kv = turn.prior_tokens > 0
        self._active[sid] = turn
        if not marked:
            self.store.update_session(sid, state="active", last_active=time.time())
        return turn

    def _end_turn(self, turn: ChatTurn) -> None:
        """Commit the reply (also a partial or failed one) and the session's new state."""
        sid = turn.session_id
        generated = turn.handle.num_generated_tokens if turn.handle else 0
        if turn.handle is not None:  # what the user added, not what the server had to redo
            self.limiter.record(turn.owner,
                                generated + max(len(turn.prompt) - turn.prior_tokens, 0))
        update = {"state": "resident", "token_count": len(turn.prompt) + generated,
                  "last_active": time.time(), "fingerprint": self.offload.fingerprint}
        if turn.text or turn.finish_reason != "error":
            self.store.add_message(sid, "assistant", turn.text, token_count=generated,
                                   finish_reason=turn.finish_reason, session_fields=update)
        else:
            self.store.update_session(sid, **update)

    def _is_busy(self, sid: str) -> bool:
        return sid in self._active

    def _set_state(self, sid: str, state: str) -> None:
        if self._is_busy(sid) or self.store.get_session(sid) is None:
            return
        try:
            self.store.update_session(sid, state=state)
        except Exception:  # noqa: BLE001 - deleted meanwhile
            log.debug("session %s vanished before its state update", sid)

    def _recover(self) -> None:
        """After a restart no KV is in the pool: sessions are persisted or cold."""
        snaps = {r["session_id"] for r in self.store.snapshots()}
        for row in self.store.all_sessions():
            if row["state"] in ("active", "resident") or (
                    row["state"] == "persisted" and row["id"] not in snaps):
                self.store.update_session(
                    row["id"], state="persisted" if row["id"] in snaps else "cold")

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            try:
                for sid, (_t, _b, idle) in self.engine.resident_kv().items():
                    if idle >= self.config.idle_seconds and not self._is_busy(sid):
                        self.offload.persist(sid)
            except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
                log.exception("idle sweep failed")
