"""Users' conversations: SQLite transcripts and KV caches that follow the session."""

from __future__ import annotations

from sessions.config import SessionConfig
from sessions.manager import SessionFacts, SessionManager
from sessions.turn import ChatTurn

__all__ = ["ChatTurn", "SessionConfig", "SessionFacts", "SessionManager"]
