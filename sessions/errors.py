"""Errors of the session layer; the engine knows nothing of sessions or users."""

from __future__ import annotations

from engine.errors import CrowdchatError


class SessionNotFound(CrowdchatError):
    """No such session for this user (also when it belongs to someone else) (HTTP 404)."""


class SessionBusy(CrowdchatError):
    """The session is still answering its previous message (HTTP 409)."""


class RateLimited(CrowdchatError):
    """The user exceeded a per-user limit; retry later (HTTP 429)."""
