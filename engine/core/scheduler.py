"""Decides each step's work: who decodes, which prefill chunks run, who is admitted or preempted."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable

from engine.core.block_pool import BlockPool
from engine.core.fair_share import FcfsPolicy, SchedulePolicy
from engine.core.resident import ResidentCache, ResidentKV, common_prefix
from engine.model.plan import StepPlan
from engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 16  # prefill always progresses, even when decodes fill the token budget

__all__ = ["MIN_PREFILL_CHUNK", "Scheduler", "StepPlan"]


class Scheduler:
    """Owns the `waiting` and `running` queues; idle owners' KV lives in `resident`.

    Admission happens only when a request's prompt blocks fit; which waiting request goes
    next, in what order the prefill budget is shared and whom to preempt is the `policy`'s
    (`engine.core.fair_share`: FCFS and the youngest, or fair share by served work per user, which
    may also swap one running sequence for a waiting user a whole slot below its fair share
    of a full batch). When the pool is short it first evicts cached blocks nobody holds (a
    prompt shares the cached blocks its chain hashes find, `block_pool`), then calls the
    memory-pressure hook (the session layer persists idle owners' KV there), then drops the
    least recently used resident KV, then preempts.
    """

    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        memory_pressure: Callable[[int, str | None], None] | None = None,
        policy: SchedulePolicy | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.memory_pressure = memory_pressure
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.resident = ResidentCache(pool)
        self.num_preemptions = 0
        self.just_admitted: list[Sequence] = []  # admitted by the last `schedule`
        self.running_changes = 0  # counts changes to who is in `running` (not to its order)
        self.prefix_queries = 0  # prompt tokens admitted (vLLM's prefix-cache "queries")
        self.prefix_hits = 0  # of them, tokens whose KV was already there (shared or own)
        self.policy = policy or FcfsPolicy()

    @property
    def num_resident_dropped(self) -> int:
        return self.resident.num_dropped

    # -- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request (the engine enforces the queue cap before it gets here)."""
        self.policy.queued(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release or retain its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.running_changes += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.left(seq)
        self.policy.finished(seq)
        seq.status = SequenceStatus.FINISHED
        if seq.retain and seq.owner is not None and seq.block_table and seq.num_computed:
            keep = self.pool.blocks_for(seq.num_computed)
            self.pool.free(seq.block_table[keep:])
            self.resident.put(
                seq.owner, ResidentKV(seq.token_ids[: seq.num_computed], seq.block_table[:keep])
            )
        else:
            self.pool.free(seq.block_table)
        seq.block_table = []

    def reclaim(self, needed: int, keep_owner: str | None = None) -> bool:
        """Try to make `needed` blocks free without touching running sequences. Cached blocks
        nobody holds count as free (allocating evicts them), so they go before any session's
        KV; then the memory-pressure hook moves idle sessions out, asked again while it makes
        progress (a session whose chain is partly shared frees fewer blocks than it holds)."""
        if self.pool.can_allocate(needed):
            return True
        while self.memory_pressure is not None and len(self.resident):
            entries = len(self.resident)
            try:
                self.memory_pressure(needed - self.pool.num_free, keep_owner)
            except Exception:  # the hook is the session layer's; a bug there must not stop us
                log.exception("memory-pressure hook failed")
                break
            if self.pool.can_allocate(needed) or len(self.resident) >= entries:
                break
        self.resident.evict_lru(needed, keep_owner)
        return self.pool.can_allocate(needed)

    # -- planning -----------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it at the front to recompute later."""
        self.running.remove(seq)
        self.running_changes += 1
        self.pool.free(seq.block_table)  # its full blocks stay cached for its return
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.queued(seq)
        self.waiting.appendleft(seq)

    def _grow_running(self, plan: StepPlan) -> None:
        """Give every running sequence the blocks its next tokens need, preempting if short."""
        bs = self.pool.block_size
        # Only those past their last block need one (one a block_size of steps: the scan is the
        # step's cost). Preempting never makes a sequence left running need more.
        short = [s for s in self.running if len(s.token_ids) > len(s.block_table) * bs]
        for seq in short:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted while making room for an older one
            need = self.pool.blocks_for(seq.num_tokens) - len(seq.block_table)
            while need > 0 and not self.reclaim(need):
                victim = self.policy.victim(self.running)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING and need > 0:
                seq.block_table += self.pool.allocate(need)

    def _admit(self, seq: Sequence) -> bool:
        """Move the head of `waiting` to `running` if its blocks fit. Its prompt starts on the
        longer of its owner's resident chain and the longest cached chain of its hashes; its
        last token is always computed (its logits are the reply's first)."""
        bs, n = self.pool.block_size, seq.num_tokens
        # the owner's KV leaves `resident` while we decide, so no hook can take it meanwhile
        entry = self.resident.take(seq.owner) if seq.owner is not None else None
        own = min(common_prefix(entry.token_ids, seq.token_ids), n - 1) if entry else 0
        hits = self.pool.lookup(seq.hashes(bs)[: (n - 1) // bs])
        if entry is not None and own > len(hits) * bs:
            # what this prompt cannot reuse is stale: let it go now, or a prompt whose prefix
            # changed early could wait forever behind its own owner's KV
            table, computed = self.resident.cut(entry, own)
            seq.num_hit_tokens = 0
        else:
            self.pool.share(hits)  # held before the entry lets go: it may hold the same blocks
            if entry is not None:
                self.pool.free(entry.block_table)
            table, computed = hits, len(hits) * bs
            seq.num_hit_tokens = computed
        if not self.reclaim(self.pool.blocks_for(n) - len(table), keep_owner=seq.owner):
            if entry is not None and computed:  # kept for the next try
                self.resident.put(seq.owner, ResidentKV(seq.token_ids[:computed], table))
            else:
                self.pool.free(table)
            return False
        seq.block_table = table + self.pool.allocate(self.pool.blocks_for(n) - len(table))
        seq.num_computed = computed
        seq.num_registered = 0  # an adopted chain may hold full blocks not yet offered
        self.prefix_queries += n
        self.prefix_hits += computed
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        self.running_changes += 1
        self.just_admitted.append(seq)
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        full = min(seq.num_computed // self.pool.block_size, len(seq.block_table))
        if full <= seq.num_registered:
            return
        hashes = seq.hashes(self.pool.block_size)
        for i in range(seq.num_registered, min(full, len(hashes))):
            self.pool.register(seq.block_table[i], hashes[i])
        seq.num_registered = full

    def _plan_tokens(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        """Add `seq`'s work to the plan: a decode only when its last token alone is left
        uncomputed (only then are its logits the next token's), else a prefill chunk.
        Returns the budget left."""
        if seq.num_uncomputed == 1:
            plan.decodes.append(seq)
            return budget - 1
        n = min(seq.num_uncomputed, budget)
        plan.prefills.append((seq, n))
        return budget - n

    def schedule(self, token_budget: int) -> StepPlan:
        """Plan one step under `token_budget` tokens (decodes always run)."""
        plan = StepPlan()
        self.just_admitted = []
        victim = self.policy.slot_victim(self.running, self.waiting, self.max_num_seqs)
        if victim is not None:  # a user below its fair share of the slots takes one
            self._preempt(victim)
            plan.preempted.append(victim)
        self._grow_running(plan)
        running = self.running
        plan.decodes = [s for s in running if len(s.token_ids) - s.num_computed == 1]
        # the rest have prompt left (none has nothing left: a step's token is always fed back)
        prefilling = (
            [s for s in running if len(s.token_ids) - s.num_computed > 1]
            if len(plan.decodes) < len(running)
            else []
        )
        budget = max(token_budget - len(plan.decodes), MIN_PREFILL_CHUNK)
        admitting = len(running) < self.max_num_seqs
        for seq in self.policy.prefill_order(prefilling, self.waiting):
            if budget <= 0:
                break
            if seq.status is SequenceStatus.WAITING:
                if not admitting:
                    continue
                if len(self.running) >= self.max_num_seqs or not self._admit(seq):
                    admitting = False  # the next in line waits: nobody overtakes on blocks
                    continue
                self.policy.admitted(seq)
            budget = self._plan_tokens(plan, seq, budget)
        self.policy.charge(plan.decodes, plan.prefills)
        return plan

    def check_integrity(self) -> None:
        """Every block's refcount is the number of running sequences and resident entries
        holding it, none holds a block twice, and a block a sequence still writes is its own."""
        holders = Counter(self.resident.blocks())
        bs = self.pool.block_size
        for seq in self.running:
            holders.update(seq.block_table)
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) * bs >= seq.num_computed
            for b in seq.block_table[seq.num_computed // bs :]:  # written from here on
                assert self.pool.refcount(b) == 1 and not self.pool.is_hashed(b), (seq.seq_id, b)
        for _, entry in self.resident.items():
            assert len(set(entry.block_table)) == len(entry.block_table)
        recounted = {b for _, e in self.resident.items() for b in e.block_table}
        assert self.resident.num_blocks == len(recounted)  # the count kept between changes
        self.pool.check_integrity(holders)
        assert not any(s.block_table for s in self.waiting)
        self.policy.check(self.waiting)
