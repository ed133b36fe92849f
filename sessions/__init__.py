"""Users' conversations: SQLite transcripts and KV caches that follow the session.

Others use what `__all__` names: the manager and its config, the replies it returns, the
admin facts and stats, the session states and the session errors; and `sessions.relay`, the
one relay (typed events Delta / End / Failed) from a reply to the chat page or the API."""

from __future__ import annotations

from sessions.admin import SessionFacts, SessionStats
from sessions.config import SessionConfig
from sessions.errors import RateLimited, SessionBusy, SessionNotFound
from sessions.manager import SessionManager
from sessions.reply import Reply
from sessions.state import SessionState
from sessions.turn import ChatTurn

__all__ = [
    "ChatTurn",
    "RateLimited",
    "Reply",
    "SessionBusy",
    "SessionConfig",
    "SessionFacts",
    "SessionManager",
    "SessionNotFound",
    "SessionState",
    "SessionStats",
]
