"""The engine thread's side of `Engine`: its loop, the inbox it drains, one step.

Everything here runs on the engine thread, except `_call`, `_cancel` and `_left_queue`, which
other threads use to reach it. `Engine` (engine.core.engine) sets the attributes declared
below before it starts the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from engine.core.budget import TokenBudget
from engine.core.messages import Call, Cancel, Message, Stop, Submit
from engine.core.output import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.metrics import Metrics
from engine.model.launched import StepTokens
from engine.model.plan import StepPlan
from engine.model.runner import ModelRunner
from engine.sequence import FinishReason, Sequence, SequenceStatus

log = logging.getLogger("engine.core.engine")
T = TypeVar("T")
IDLE_WAIT_S = 0.5


@dataclass
class Ahead:
    """A launched step whose tokens the host has not read yet (run-ahead)."""

    plan: StepPlan
    tokens: StepTokens
    t0: float  # perf_counter at its launch


def live(plan: StepPlan) -> StepPlan:
    """`plan` without the sequences that ended since it was made."""
    done = SequenceStatus.FINISHED
    return StepPlan(
        decodes=[s for s in plan.decodes if s.status is not done],
        prefills=[(s, n) for s, n in plan.prefills if s.status is not done],
        preempted=plan.preempted,
    )


class EngineLoop:
    """Continuous batching on one thread: drain the inbox, schedule, run, process, publish.

    Where the runner runs ahead (`ModelRunner.runs_ahead`: CUDA), a step is launched, counted
    (each sampled row gets a placeholder token) and its tokens read only after the next step
    is launched, whose decodes take them on the device: the inbox, the schedule, the next
    step's inputs and the output pass of step N all run while step N+1 runs on the GPU. A step
    that cannot take them there (prefills, penalties, too wide) reads them first."""

    scheduler: Scheduler
    runner: ModelRunner
    output: OutputProcessor
    metrics: Metrics
    budget: TokenBudget
    _lock: threading.Lock  # guards _pending, _stopping, _failure and the inbox's end
    _inbox: queue.Queue[Message]
    _thread: threading.Thread
    _pending: int
    _stopping: bool
    _failure: str | None
    _inbox_closed: bool
    gauges: tuple[int, int, int]
    _queue_positions: dict[int, int]
    _running_ids: frozenset[int]
    _running_seen: int  # the scheduler's `running_changes` when `_running_ids` was built
    _ahead: Ahead | None = None  # the launched step whose tokens are not read yet
    _landed_at: float = 0.0  # perf_counter when the last launched step's tokens were read

    def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and return its result (on the caller's thread once
        the engine thread has ended: then nothing else touches the pool)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future[T] = Future()
        with self._lock:
            closed = self._inbox_closed
            if not closed:
                self._inbox.put(Call(fn, fut))
        return fn() if closed else fut.result()

    def _cancel(self, seq_id: int) -> None:
        self._inbox.put(Cancel(seq_id))

    def _left_queue(self) -> None:
        with self._lock:
            self._pending -= 1

    def _handle(self, msg: Message) -> None:
        match msg:
            case Submit(request):
                self.output.add(request)
            case Cancel(seq_id):
                self.output.cancel(seq_id)
            case Call(fn, future):
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    future.set_exception(e)
            case Stop():
                self._stopping = True

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(msg)
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _loop(self) -> None:
        reason = "the server is shutting down"
        try:
            while not self._stopping:
                work = self.scheduler.has_work() or self._ahead is not None
                self._drain(block=not work)
                if not self._stopping and (self.scheduler.has_work() or self._ahead is not None):
                    self._step()
                self._publish()
        except BaseException as e:  # noqa: BLE001 - nobody would wait forever: fail them all
            log.critical("the engine thread failed; refusing new work", exc_info=e)
            reason = f"the engine failed ({type(e).__name__}: {e}); the server must restart"
            with self._lock:
                self._failure = reason
        finally:
            with self._lock:  # from here on submit() refuses and _call() runs on its caller
                self._stopping = True
                self._inbox_closed = True
            self.output.fail_all(reason)
            while True:  # answer what raced with the end: calls run, requests fail
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                match msg:
                    case Call():
                        self._handle(msg)
                    case Submit(request):
                        request.handle._finish(FinishReason.ERROR, reason)
            self._publish()

    def _step(self) -> None:
        """Schedule, run, process; where the runner runs ahead (CUDA), launch this step before
        the last one's tokens are read, so the host's work overlaps the device's."""
        plan = self.scheduler.schedule(self.budget.next(self.scheduler))
        self.output.count_admitted()
        ahead = self._ahead
        feed = None
        if ahead is not None and plan:
            feed = self.runner.feed(plan, ahead.tokens)  # type: ignore[attr-defined]
        if ahead is not None and feed is None:  # this step needs the last one's tokens here
            self._ahead = None
            self._land(ahead)
            plan = live(plan)
            if not plan:
                return
        if not plan:
            self._drain(block=True)  # nothing fits: wait for a cancel or a release
            return
        if getattr(self.runner, "runs_ahead", False):
            self._launch(plan, feed)
            if ahead is not None and feed is not None:
                self._land(ahead)
            return
        t0 = time.perf_counter()
        next_tokens = self._run(plan)
        if next_tokens is None:
            return
        ms = (time.perf_counter() - t0) * 1000
        now = time.monotonic()
        self.output.process(plan, next_tokens, now)
        self._record(plan, ms, now, len(next_tokens))

    def _run(self, plan: StepPlan) -> dict[Sequence, int] | None:
        """The runner's next tokens, or None when the step failed (and with it its requests)."""
        try:
            return self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            self._failed(plan, e)
            return None

    def _failed(self, plan: StepPlan, e: Exception) -> None:
        """A step that raised: its requests fail, everyone else is served on."""
        log.exception("model step failed; failing its %d requests", len(plan.sequences))
        self.output.fail(plan.sequences, f"generation failed: {e}")

    def _record(self, plan: StepPlan, ms: float, now: float, sampled: int) -> None:
        """A processed step's time, for the token budget's fit and the metrics."""
        self.budget.record(plan, ms)
        self.metrics.record_step(
            now,
            ms,
            len(plan.decodes) + len(plan.prefills),
            sampled,
            sum(n for _, n in plan.prefills),
        )

    def _launch(self, plan: StepPlan, feed: object | None) -> None:
        """Start `plan` on the device and count it as computed; its tokens are read at the next
        step (`_land`). Where the launch fails, the step before is landed and this one's
        requests fail."""
        t0 = time.perf_counter()
        try:
            tokens = self.runner.launch(plan, feed)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                self._land(ahead)
            self._failed(plan, e)
            return
        self.output.advance(plan, tokens.sampled)
        self._ahead = Ahead(plan, tokens, t0)

    def _land(self, ahead: Ahead) -> None:
        """Read a launched step's tokens (waiting for the device) and process them."""
        plan = ahead.plan
        try:
            ids = ahead.tokens.tokens()
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            self._failed(plan, e)
            return
        now = time.monotonic()
        # the step's period as a user sees it: from the last step's tokens to its own
        end = time.perf_counter()
        ms = (end - max(ahead.t0, self._landed_at)) * 1000
        self._landed_at = end
        sampled = ahead.tokens.sampled
        self.output.emit(plan, list(zip(sampled, ids, strict=True)), now)
        self._record(plan, ms, now, len(sampled))

    def _publish(self) -> None:
        sched = self.scheduler
        self.gauges = (len(sched.running), len(sched.resident), sched.resident.num_blocks)
        order = sched.policy.admission_order(sched.waiting) if sched.waiting else []
        self._queue_positions = {s.seq_id: i for i, s in enumerate(order)}
        if self._running_seen != sched.running_changes:  # rebuilt only when it changed
            self._running_seen = sched.running_changes
            self._running_ids = frozenset(s.seq_id for s in sched.running)
