"""What other threads put in the engine thread's inbox: small frozen messages, one per kind."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.core.output import Request


@dataclass(frozen=True)
class Submit:
    """Queue a new request."""

    request: Request


@dataclass(frozen=True)
class Cancel:
    """End a request early (its owner pressed Stop or went away)."""

    seq_id: int


@dataclass(frozen=True)
class Call:
    """Run `fn` on the engine thread (it touches the pool) and hand its result to `future`."""

    fn: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class Stop:
    """Shut the engine thread down; requests still in flight fail."""


Message = Submit | Cancel | Call | Stop
