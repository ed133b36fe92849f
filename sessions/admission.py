"""What a request must pass before the engine sees it: the per-identity caps, then the token
budget, charged when the work is admitted and settled when it ends.

A client (an address of the open API, an API key, a browser) that serves people of its own (an
app's backend) may name the end user of a request: the per-user limits then count that end
user within the client (`limit_key`), and all the client's requests together count against
--tokens-per-minute-per-client, so a new name per request buys no more than that cap."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from engine import RequestHandle, SamplingParams
from sessions.caps import IdentityCaps, Slot
from sessions.config import SessionConfig
from sessions.limits import Reservation, TokenRateLimiter
from sessions.state import SessionState


def limit_key(owner: str, end_user: str | None) -> str:
    """Whom the per-user limits count: the caller `owner`, or the end user it named (within
    that caller: the same name from two callers is two people). An end user's name holds no
    control character (the API checks), so the separator cannot be forged."""
    return owner if end_user is None else f"{owner}\x1fend-user:{end_user}"


@dataclass
class Ticket:
    """One admitted request: its place among the owner's requests in flight and, once its
    prompt is known, the tokens reserved for it, against its user's budget (`who`: the owner
    or the end user it named) and against its client's (`owner`'s) cap."""

    owner: str
    who: str
    slot: Slot
    reservation: Reservation | None = None
    client_reservation: Reservation | None = None


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
        self.client_limiter = TokenRateLimiter(
            config.tokens_per_minute_per_client,
            scope="per client, all its end users together (--tokens-per-minute-per-client)",
            subject="your address or key has",
        )
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
    def holding(self, owner: str, turn: bool, end_user: str | None = None) -> Iterator[Ticket]:
        """A ticket for one request of `owner` for `end_user` (None: the owner's own), or
        RateLimited beyond a cap; if the block raises, the ticket is given back uncharged.
        Otherwise whoever the block handed the ticket to must `end` it."""
        who = limit_key(owner, end_user)
        ticket = Ticket(owner, who, self.caps.admit(owner, turn, who))
        try:
            yield ticket
        except BaseException:
            self.end(ticket, 0)
            raise

    def reserve(self, ticket: Ticket, prompt_tokens: int, params: SamplingParams) -> None:
        """Hold the prompt tokens to compute plus the whole reply budget (RateLimited if that
        passes the user's budget or the client's cap; the holder ends the ticket then)."""
        assert ticket.reservation is None, "a ticket reserves once"
        tokens = prompt_tokens + params.max_new_tokens
        ticket.reservation = self.limiter.reserve(ticket.who, tokens)
        ticket.client_reservation = self.client_limiter.reserve(ticket.owner, tokens)

    def end(self, ticket: Ticket, charged: int) -> None:
        """The request ended having cost `charged` tokens: settle and free its place."""
        if ticket.reservation is not None:
            self.limiter.settle(ticket.reservation, charged)
        if ticket.client_reservation is not None:
            self.client_limiter.settle(ticket.client_reservation, charged)
        self.caps.release(ticket.slot)

    def usage(
        self, owner: str, conversations: int, end_user: str | None = None
    ) -> dict[str, int | float | str | None]:
        """Where `owner` stands against each limit, or the end user it names (`end_user`):
        tokens this minute (charged and reserved) and when the oldest charge frees, turns in
        flight (the user's), requests in flight and conversations kept (the client's), and the
        client's standing against --tokens-per-minute-per-client. A limit of 0 is off."""
        who = limit_key(owner, end_user)
        used, reserved, frees = self.limiter.standing(who)
        requests, _turns = self.caps.in_flight(owner)
        _requests, turns = self.caps.in_flight(who)
        client_used, client_reserved, _frees = self.client_limiter.standing(owner)
        c = self.config
        return {
            "end_user": end_user,
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
            "client_tokens_used": client_used,
            "client_tokens_reserved": client_reserved,
            "tokens_per_minute_per_client": c.tokens_per_minute_per_client,
        }

    @property
    def refused(self) -> int:
        """Requests and creations refused by a cap or the token budget."""
        tokens = self.limiter.refused + self.client_limiter.refused
        return tokens + sum(self.caps.refused.values())
