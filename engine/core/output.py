"""After each step: sampled tokens become stream deltas, latency samples and finished requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.scheduler import Scheduler
from engine.handle import RequestHandle
from engine.metrics import Metrics
from engine.model.plan import StepPlan
from engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class Request:
    """A request as the engine thread tracks it: its sequence, its caller's handle, its text."""

    seq: Sequence
    handle: RequestHandle
    # the engine thread's detokenizer where the request has stop strings (it must see them
    # before the next step); None where the handle's reader decodes (`RequestHandle._detok`)
    detok: IncrementalDetokenizer | None
    admitted: bool = False  # left the queue (counts no more against --max-queue)
    # set by `OutputProcessor.add`, so a step's pass reads two fields, not five
    stops: frozenset[int] = frozenset()  # token ids that end it (none with ignore_eos)
    end: int = 0  # its length (prompt + reply) at which it ends: max_new_tokens or the model's


class OutputProcessor:
    """Owns the engine thread's table of live requests and ends each one exactly once.

    `left_queue` is called once for every request that stops counting against the queue cap
    (admitted, or ended before it was admitted).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics,
        stop_ids: list[int],
        max_model_len: int,
        left_queue: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.stop_ids = frozenset(stop_ids)
        self.max_model_len = max_model_len
        self.left_queue = left_queue
        self.requests: dict[int, Request] = {}

    def add(self, req: Request) -> None:
        seq = req.seq
        req.stops = frozenset() if seq.params.ignore_eos else self.stop_ids
        req.end = min(seq.num_prompt_tokens + seq.params.max_new_tokens, self.max_model_len)
        self.requests[seq.seq_id] = req
        self.scheduler.add(req.seq)

    def cancel(self, seq_id: int) -> None:
        req = self.requests.get(seq_id)
        if req is not None:
            self.finish(req, FinishReason.CANCELLED)

    def count_admitted(self) -> None:
        """Requests that reached the running batch (in the last `schedule`) leave the queue."""
        for seq in self.scheduler.just_admitted:
            req = self.requests.get(seq.seq_id)
            if req is not None and not req.admitted:
                req.admitted = True
                req.handle.num_cached_tokens = seq.num_computed
                req.handle.num_hit_tokens = seq.num_hit_tokens
                req.handle.admitted = True
                self.left_queue()
                self.metrics.record_admission(time.monotonic())

    def process(self, plan: StepPlan, next_tokens: dict[Sequence, int], now: float) -> None:
        """Record what the step computed and hand each sampled token to its request."""
        sched = self.scheduler
        bs = sched.pool.block_size
        for seq in plan.decodes:
            seq.num_computed += 1
            if seq.num_computed // bs > seq.num_registered:  # a block filled: offer it
                sched.cache_computed(seq)
        for seq, n in plan.prefills:
            seq.num_computed += n
            sched.cache_computed(seq)
        self._hand_out(next_tokens, now)

    def advance(self, plan: StepPlan, sampled: list[Sequence]) -> None:
        """Right after a step is launched whose tokens come later (run-ahead): what it
        computes counts, and each sampled row gets a placeholder for its token, so the next
        step is scheduled with it (as vLLM v1's async scheduler does). `emit` fills them in."""
        for seq in plan.decodes:
            seq.num_computed += 1
        for seq, n in plan.prefills:
            seq.num_computed += n
        for seq in sampled:
            seq.token_ids.append(PLACEHOLDER)

    def emit(self, plan: StepPlan, tokens: list[tuple[Sequence, int]], now: float) -> None:
        """A step `advance`d earlier, its tokens read: each takes its placeholder's place
        (the last one, or the one before where the next step was launched too: that one's
        placeholder goes back after), then the blocks the step filled, their tokens now known,
        are offered. A request that ended meanwhile (a stop found a step before, a cancel)
        gets nothing: that token is never shown."""
        requests = self.requests
        live: dict[Sequence, int] = {}
        again: list[Sequence] = []  # launched once more since
        for seq, token in tokens:
            if seq.seq_id in requests:
                ids = seq.token_ids
                ids.pop()
                if ids[-1] == PLACEHOLDER:
                    ids.pop()
                    again.append(seq)
                live[seq] = token
        self._hand_out(live, now)
        sched = self.scheduler
        bs = sched.pool.block_size
        running = SequenceStatus.RUNNING
        for seq in plan.sequences:
            if seq.status is running and seq.num_computed // bs > seq.num_registered:
                sched.cache_computed(seq)
        for seq in again:
            if seq.status is running:
                seq.token_ids.append(PLACEHOLDER)

    def _hand_out(self, next_tokens: dict[Sequence, int], now: float) -> None:
        """Append each token to its sequence and hand it to its request. One pass a row, its
        work inlined: at 256 rows every call a row costs ~0.03 ms a step, engine-thread time a
        GPU waits on."""
        itl: list[float] = []
        ttft: list[float] = []
        requests = self.requests
        ended: list[tuple[Request, FinishReason, int | None]] = []
        woken: list[RequestHandle] = []  # handles whose reader waits: woken once, after the pass
        for seq, token in next_tokens.items():
            last = seq.last_token_at
            if last is None:
                seq.first_token_at = now
                ttft.append(now - seq.arrival)
            else:
                itl.append(now - last)
            seq.last_token_at = now
            req = requests[seq.seq_id]
            ids = seq.token_ids
            ids.append(token)
            if token in req.stops:  # joins the handle's ids at the end, with no text
                ended.append((req, FinishReason.STOP, token))
                continue
            handle = req.handle
            handle.token_ids.append(token)  # no lock: `RequestHandle`'s hand-off
            detok = req.detok
            if detok is None:  # the reader decodes; it is woken only if it waits
                if handle.reader_waiting:
                    woken.append(handle)
            else:
                handle._push(detok.push(token))
                if detok.stopped:
                    ended.append((req, FinishReason.STOP, None))
                    continue
            if len(ids) >= req.end:  # max_new_tokens generated, or the model's length
                ended.append((req, FinishReason.LENGTH, None))
        for handle in woken:
            handle.wake_reader()
        m = self.metrics
        with m.lock:  # latencies: one acquisition a step, not one a row
            m.ttft.extend(ttft)
            m.ttft_hist.observe_all(ttft)
            m.itl.extend(itl)
            m.itl_hist.observe_all(itl)
        for req, reason, stop_token in ended:
            self.finish(req, reason, last_token=stop_token)

    def fail(self, seqs: list[Sequence], error: str) -> None:
        for seq in seqs:
            req = self.requests.get(seq.seq_id)
            if req is not None:
                self.finish(req, FinishReason.ERROR, error)

    def fail_all(self, error: str) -> None:
        for req in list(self.requests.values()):
            self.finish(req, FinishReason.ERROR, error)

    def finish(
        self,
        req: Request,
        reason: FinishReason,
        error: str | None = None,
        last_token: int | None = None,
    ) -> None:
        """End the request: free or retain its blocks, flush its text, wake its caller.
        `last_token`: the stop token that ended it (counted, never shown)."""
        seq = req.seq
        ids = seq.token_ids
        if ids and ids[-1] == PLACEHOLDER:  # steps launched after its end: never shown
            del ids[ids.index(PLACEHOLDER) :]
        # run-ahead counts the step launched after its last token: keep what a step at a time
        # computes, all but the last token (a no-op there)
        seq.num_computed = min(seq.num_computed, len(ids) - 1)
        if seq.status is not SequenceStatus.FINISHED:
            if not req.admitted:
                req.admitted = True
                self.left_queue()
            self.scheduler.remove(seq)
        self.requests.pop(seq.seq_id, None)
        if reason is not FinishReason.ERROR and req.detok is not None:
            req.handle._push(req.detok.flush())  # (a reader's detokenizer flushes at the end)
        with self.metrics.lock:
            if reason is FinishReason.ERROR:
                self.metrics.failed += 1
            else:
                self.metrics.finished += 1
        req.handle._finish(reason, error, last_token=last_token)
