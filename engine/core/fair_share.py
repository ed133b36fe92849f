"""Who is admitted next and who gets the step's prefill budget: FCFS, or fair share by served work.

`VirtualTokenCounter` is the VTC of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024): a counter of weighted service per user (prompt tokens computed x `w_prompt`,
generated tokens x `w_gen`); admission picks the backlogged user (one with queued requests)
with the least counter, FCFS within a user; a user who becomes backlogged is lifted to the
least counter of the backlogged users (or, with none, of the last one to leave the queue), so
idle time is not banked (as in the paper, the last level is taken before that user's
admission charge; a user with requests still running keeps up to one request's deficit, see
`queued`). Work-conserving: a user alone gets everything.

Both policies also count the tokens computed per user (`engine.served`) for `/metrics` and the
admin page. The engine thread calls every method except `served_top`, which any thread may call.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from engine.sequence import Sequence
from engine.served import ServedTokens, step_tokens, user_of

__all__ = ["FcfsPolicy", "SchedulePolicy", "VirtualTokenCounter", "make_policy", "max_min_share"]

COUNTERS_CAP = 4096  # beyond this many counters, idle users at or below the floor are dropped


class SchedulePolicy:
    """FCFS admission (the base behaviour) plus per-user served-token accounting."""

    name = "fcfs"

    def __init__(self) -> None:
        self.served = ServedTokens()

    # -- queue events (engine thread) -----------------------------------------------------
    def queued(self, seq: Sequence) -> None:
        """`seq` entered `waiting` (new, or preempted)."""

    def left(self, seq: Sequence) -> None:
        """`seq` left `waiting` (admitted or ended)."""

    def admitted(self, seq: Sequence) -> None:
        """`seq` was admitted; `num_computed` tokens of it were reused, the rest is to compute."""
        self.left(seq)

    def finished(self, seq: Sequence) -> None:
        """`seq` left the engine (ended, waiting or running)."""

    # -- decisions ------------------------------------------------------------------------
    def prefill_order(
        self, running: list[Sequence], waiting: Iterable[Sequence]
    ) -> Iterator[Sequence]:
        """Running sequences with prompt left, then waiting ones, in the order the step's
        prefill budget goes to them (a waiting one is admitted when its turn comes)."""
        yield from [s for s in running if s.num_uncomputed > 1]
        yield from list(waiting)

    def admission_order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """The waiting sequences in the order they would be admitted from now on."""
        return list(waiting)

    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when the pool is short: the youngest."""
        return running[-1]

    def slot_victim(
        self, running: list[Sequence], waiting: Iterable[Sequence], max_num_seqs: int
    ) -> Sequence | None:
        """A running sequence to give up its batch slot to a waiting user (None: keep all)."""
        return None

    # -- accounting -----------------------------------------------------------------------
    def charge(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> None:
        """Record a planned step: each decode and each prompt-finishing chunk yields a token."""
        step = step_tokens(decodes, prefills)
        self.served.record(step)
        for user, (_, made) in step.items():
            if made:
                self.generated(user, made)

    def generated(self, user: str, n: int) -> None:
        """`user`'s sequences are about to produce `n` tokens (VTC charges them)."""

    def served_top(self, n: int) -> list[tuple[str, int, int]]:
        """The `n` most served users by label, then "other" (any thread; `ServedTokens.top`)."""
        return self.served.top(n)

    def check(self, waiting: Iterable[Sequence]) -> None:
        """Assert the policy's view of the queue matches `waiting`."""


FcfsPolicy = SchedulePolicy


class VirtualTokenCounter(SchedulePolicy):
    """Fair share by served work per user (see the module docstring)."""

    name = "fair"

    def __init__(self, w_prompt: float = 1.0, w_gen: float = 2.0) -> None:
        super().__init__()
        self.w_prompt = w_prompt
        self.w_gen = w_gen
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}  # user -> sequences waiting
        self.active: dict[str, int] = {}  # user -> sequences waiting or running
        self.last_left = 0.0  # counter of the last user whose queue emptied

    def counter(self, user: str) -> float:
        return self.counters.get(user, 0.0)

    def floor(self) -> float:
        """Where a newly backlogged user starts: the least backlogged counter."""
        if not self.backlog:
            return self.last_left
        return min(self.counter(u) for u in self.backlog)

    def queued(self, seq: Sequence) -> None:
        user = user_of(seq)
        others = self.active.get(user, 0) - (1 if seq.num_preemptions else 0)
        if not seq.num_preemptions:  # new to the engine (a preempted one never left it)
            self.active[user] = self.active.get(user, 0) + 1
        if user not in self.backlog:
            floor = self.floor()
            if others:
                # Still being served, so not idle: it keeps a deficit of up to one request.
                # Else a user whose next request reaches the queue a moment after its last
                # one's slot was refilled would lose its share at every turn (measured with
                # 16/4/1 requests outstanding on 8 slots: 0.385 of the tokens for the user
                # owed 0.4375). Bounded, so a long-active light user cannot bank a burst.
                floor -= self.w_prompt * seq.num_tokens + self.w_gen * seq.params.max_new_tokens
            self.counters[user] = max(self.counter(user), floor)
        self.backlog[user] = self.backlog.get(user, 0) + 1

    def finished(self, seq: Sequence) -> None:
        user = user_of(seq)
        left = self.active.get(user, 0) - 1
        if left > 0:
            self.active[user] = left
        else:
            self.active.pop(user, None)

    def left(self, seq: Sequence) -> None:
        user = user_of(seq)
        left = self.backlog.get(user, 0) - 1
        assert left >= 0, f"{user} left a queue it was not in"
        if left:
            self.backlog[user] = left
        else:
            del self.backlog[user]
            self.last_left = self.counter(user)

    def check(self, waiting: Iterable[Sequence]) -> None:
        counts: dict[str, int] = {}
        for seq in waiting:
            counts[user_of(seq)] = counts.get(user_of(seq), 0) + 1
        assert counts == self.backlog, (counts, self.backlog)

    def admitted(self, seq: Sequence) -> None:
        # leave first: `last_left` is the level before this prompt's charge, so a user arriving
        # next is not lifted above a prompt that is still being prefilled
        self.left(seq)
        user = user_of(seq)
        self.counters[user] = self.counter(user) + self.w_prompt * _prompt_cost(seq)

    def generated(self, user: str, n: int) -> None:
        counter = self.counter(user)
        for _ in range(n):  # one addition a token, as a row at a time did: the same float
            counter += self.w_gen
        self.counters[user] = counter

    def prefill_order(
        self, running: list[Sequence], waiting: Iterable[Sequence]
    ) -> Iterator[Sequence]:
        work: dict[str, deque[Sequence]] = {}
        for seq in [s for s in running if s.num_uncomputed > 1] + list(waiting):
            work.setdefault(user_of(seq), deque()).append(seq)
        self._prune(work)
        # Only the yielded user's counter changes while the caller works (an admission's
        # charge), so a heap re-keyed for that user alone stays exact.
        heap = [(self.counter(u), q[0].seq_id, u) for u, q in work.items()]
        heapq.heapify(heap)
        while heap:
            _, _, user = heapq.heappop(heap)
            queue = work[user]
            yield queue.popleft()
            if queue:
                heapq.heappush(heap, (self.counter(user), queue[0].seq_id, user))

    def admission_order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        counters, work = dict(self.counters), {}
        for seq in waiting:
            work.setdefault(user_of(seq), deque()).append(seq)
        heap = [(counters.get(u, 0.0), q[0].seq_id, u) for u, q in work.items()]
        heapq.heapify(heap)
        order = []
        while heap:
            c, _, user = heapq.heappop(heap)
            seq = work[user].popleft()
            order.append(seq)
            counters[user] = c + self.w_prompt * _prompt_cost(seq)
            if work[user]:
                heapq.heappush(heap, (counters[user], work[user][0].seq_id, user))
        return order

    def victim(self, running: list[Sequence]) -> Sequence:
        """The youngest running sequence of the user with the most service."""
        heaviest = max({user_of(s) for s in running}, key=lambda u: (self.counter(u), u))
        return next(s for s in reversed(running) if user_of(s) == heaviest)

    def slot_victim(
        self, running: list[Sequence], waiting: Iterable[Sequence], max_num_seqs: int
    ) -> Sequence | None:
        """With every slot taken: the youngest sequence of the user most above its max-min fair
        share of the slots, if a waiting user with less service is a whole slot below its own.

        Without this a user with one request outstanding waits at every turn for the next slot
        to free (A, B, C keeping 16, 4, 1 requests on 8 slots: C got 0.86 of its slot in the
        fake-model simulation). The hysteresis (a whole slot below, strictly above) means the
        swap cannot reverse at the next step; the victim is recomputed later, uncharged.
        """
        if len(running) < max_num_seqs or not waiting:  # nobody waits: demand is what is held
            return None
        held: dict[str, int] = {}
        for seq in running:
            held[user_of(seq)] = held.get(user_of(seq), 0) + 1
        demand = dict(held)
        for seq in waiting:
            demand[user_of(seq)] = demand.get(user_of(seq), 0) + 1
        if demand == held:
            return None
        share = max_min_share(demand, max_num_seqs)
        short = [u for u in demand if held.get(u, 0) + 1 <= share[u]]
        over = [u for u in held if held[u] > share[u]]
        if not short or not over:
            return None
        taker = min(short, key=lambda u: (self.counter(u), u))
        giver = max(over, key=lambda u: (held[u] - share[u], self.counter(u), u))
        if self.counter(taker) >= self.counter(giver):
            return None
        return next(s for s in reversed(running) if user_of(s) == giver)

    def _prune(self, work: dict[str, deque[Sequence]]) -> None:
        """Forget idle users who could gain nothing by being remembered: on return they are
        lifted to at least the floor anyway (bounds memory under many identities)."""
        if len(self.counters) <= COUNTERS_CAP:
            return
        floor = self.floor()
        for user in [u for u, c in self.counters.items() if c <= floor and u not in work]:
            if user not in self.backlog:
                del self.counters[user]


def max_min_share(demand: dict[str, int], slots: int) -> dict[str, float]:
    """Water-filling: each user gets min(its demand, an equal split of what is left)."""
    share: dict[str, float] = {}
    left, todo = float(slots), dict(demand)
    while todo:
        each = left / len(todo)
        small = {u: d for u, d in todo.items() if d <= each}
        if not small:
            share.update(dict.fromkeys(todo, each))
            break
        for u, d in small.items():
            share[u] = float(d)
            left -= d
            del todo[u]
    return share


def _prompt_cost(seq: Sequence) -> int:
    """Prompt tokens an admission computes: none again for a preempted sequence (the user was
    charged once; recomputing is the server's choice), else what its reused KV does not hold."""
    return 0 if seq.num_preemptions else seq.num_tokens - seq.num_computed


def make_policy(name: str) -> SchedulePolicy:
    """The policy `--schedule` names."""
    return VirtualTokenCounter() if name == "fair" else FcfsPolicy()
