"""What a request must pass before the engine sees it: the per-identity caps, then the token
budget, charged when the work is admitted and settled when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from engine import RequestHandle, SamplingParams
from sessions.caps import IdentityCaps, Slot
from sessions.config import SessionConfig
from sessions.limits import Reservation, TokenRateLimiter
from sessions.state import SessionState


@dataclass
class Ticket:
    """One admitted request: its place among the owner's requests in flight and, once its
    prompt is known, the tokens reserved for it."""

    owner: str
    slot: Slot
    reservation: Reservation | None = None


def cost(handle: RequestHandle | None) -> int:
    """What a request cost the server: the prompt tokens it computed (none if it never left
    the queue; all but a prefix served from resident KV otherwise) and the tokens it generated."""
    if handle is None:
        return 0
    prefilled = handle.num_prompt_tokens - handle.num_cached_tokens if handle.admitted else 0
    return max(prefilled, 0) + handle.num_generated_tokens


def prompt_to_compute(session: dict, prompt: list[int]) -> int:
    """The prompt tokens a session's turn will compute, as far as the session layer knows
    before the engine looks: those beyond the tokens its kept KV covers (all of them when the
    session is cold, i.e. its history must be recomputed). The charge at the end is exact."""
    kept = 0 if session["state"] == SessionState.COLD else session["token_count"]
    return max(len(prompt) - kept, 0)


class Admission:
    """The caps and the token budget of every user, applied in one place for session turns
    and one-off completions alike."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.limiter = TokenRateLimiter(config.tokens_per_minute)
        self.caps = IdentityCaps(config)

    def clamp(self, params: SamplingParams) -> SamplingParams:
        """The reply length capped at --max-tokens-per-turn."""
        cap = self.config.max_tokens_per_turn
        if params.max_new_tokens > cap:
            params = replace(
                params, max_new_tokens=cap, min_new_tokens=min(params.min_new_tokens, cap)
            )
        return params

    @contextmanager
    def holding(self, owner: str, turn: bool) -> Iterator[Ticket]:
        """A ticket for one request of `owner` (RateLimited beyond a cap); if the block
        raises, the ticket is given back uncharged. Otherwise whoever the block handed the
        ticket to must `end` it."""
        ticket = Ticket(owner, self.caps.admit(owner, turn))
        try:
            yield ticket
        except BaseException:
            self.end(ticket, 0)
            raise

    def reserve(self, ticket: Ticket, prompt_tokens: int, params: SamplingParams) -> None:
        """Hold the prompt tokens to compute plus the whole reply budget (RateLimited if that
        passes the owner's budget)."""
        assert ticket.reservation is None, "a ticket reserves once"
        ticket.reservation = self.limiter.reserve(
            ticket.owner, prompt_tokens + params.max_new_tokens
        )

    def end(self, ticket: Ticket, charged: int) -> None:
        """The request ended having cost `charged` tokens: settle and free its place."""
        if ticket.reservation is not None:
            self.limiter.settle(ticket.reservation, charged)
        self.caps.release(ticket.slot)

    def usage(self, owner: str, conversations: int) -> dict[str, int | float]:
        """Where `owner` stands against each limit: tokens this minute (charged and reserved)
        and when the oldest charge frees, requests and turns in flight, conversations kept.
        A limit of 0 is off."""
        used, reserved, frees = self.limiter.standing(owner)
        requests, turns = self.caps.in_flight(owner)
        c = self.config
        return {
            "tokens_used": used,
            "tokens_reserved": reserved,
            "tokens_per_minute": c.tokens_per_minute,
            "tokens_free_in_seconds": round(frees, 1),
            "turns_answering": turns,
            "max_turns_per_user": c.max_turns_per_user,
            "requests_in_flight": requests,
            "max_requests_per_user": c.max_requests_per_user,
            "conversations": conversations,
            "max_sessions_per_user": c.max_sessions_per_user,
        }

    @property
    def refused(self) -> int:
        """Requests and creations refused by a cap or the token budget."""
        return self.limiter.refused + sum(self.caps.refused.values())
