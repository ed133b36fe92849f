"""Where a session's KV is: the states the store records and the admin page shows."""

from __future__ import annotations

import enum


class SessionState(enum.StrEnum):
    """A StrEnum, so it equals the plain strings the store has always recorded."""

    ACTIVE = "active"  # a turn is running
    RESIDENT = "resident"  # its KV is in the engine's pool
    PERSISTED = "persisted"  # its KV is in host RAM or a snapshot file
    COLD = "cold"  # no KV anywhere: the next turn recomputes the prefix
