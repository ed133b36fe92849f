"""The engine thread: owns the model, the KV pool and the scheduler; others talk to it by queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import EngineStopped, InvalidRequest, PromptTooLong, ServerBusy
from engine.handle import RequestHandle
from engine.kv_cache import KVCache, bytes_per_token, kv_budget_bytes
from engine.loader import LoadedModel, load_model
from engine.metrics import EngineStats, Metrics, StepTimer, percentile
from engine.model_runner import ModelRunner
from engine.scheduler import MIN_PREFILL_CHUNK, ResidentKV, Scheduler, StepPlan
from engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from engine.threads import run_in_fresh_thread

log = logging.getLogger(__name__)
T = TypeVar("T")


def attention_work(plan: StepPlan) -> float:
    """Query-key pairs the step's attention computes (see StepTimer)."""
    work = sum(s.num_computed + 1 for s in plan.decodes)
    return work + sum(n * (s.num_computed + n / 2) for s, n in plan.prefills)
IDLE_WAIT_S = 0.5


@dataclass
class _Request:
    seq: Sequence
    handle: RequestHandle
    detok: IncrementalDetokenizer
    admitted: bool = False


@dataclass(frozen=True)
class KVExport:
    """An owner's resident KV copied to CPU: the token ids it covers, K and V `[L, T, H_kv, D]`."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor


class Engine:
    """One model, one KV pool, one background thread doing continuous batching.

    Thread-safe: `submit`, `cancel` (through the handle), `stats`, the resident-KV calls and
    `shutdown` may be called from any thread; only the engine thread touches the model.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.kv_bytes_per_token = bytes_per_token(self.loaded)
        budget = kv_budget_bytes(config, self.loaded)
        num_blocks = budget // (self.kv_bytes_per_token * config.block_size)
        if num_blocks < 2:
            raise InvalidRequest(f"KV budget {budget / 2**20:.1f} MB holds fewer than 2 blocks; "
                                 "raise --kv-budget-mb or --gpu-memory-utilization")
        # zero-filling is an OpenMP region: keep it off the caller's thread (engine.threads)
        self.cache = run_in_fresh_thread(lambda: KVCache(self.loaded, num_blocks,
                                                         config.block_size))
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs)
        self.runner = ModelRunner(self.loaded, self.cache)
        self.max_model_len = min(config.max_model_len or self.loaded.max_position,
                                 num_blocks * config.block_size)
        self.vocab_size = self.loaded.model.config.vocab_size
        self.metrics = Metrics()
        self.timer = StepTimer(config.target_itl_ms, config.max_num_batched_tokens,
                               MIN_PREFILL_CHUNK)
        self._requests: dict[int, _Request] = {}
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet admitted or finished: the queue the cap limits
        self._stopping = False
        self._step_hook: Callable[[StepPlan], None] | None = None  # tests inject faults here
        # Published by the engine thread after each step, read by stats() from any thread.
        self._gauges: tuple[int, int, int] = (0, 0, 0)
        self._last_budget = config.max_num_batched_tokens
        self._queue_positions: dict[int, int] = {}
        self._running_ids: frozenset[int] = frozenset()
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MB (%d bytes/token); "
                 "model %.1f MB", num_blocks, config.block_size, num_blocks * config.block_size,
                 self.cache.nbytes / 2**20, self.kv_bytes_per_token,
                 self.loaded.model_bytes / 2**20)
        self._thread = threading.Thread(target=self._loop, name="crowdchat-engine", daemon=True)
        self._thread.start()

    # -- public API, any thread ---------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               owner: str | None = None, retain: bool = False) -> RequestHandle:
        """Queue a request; stream its reply from the returned handle.

        `owner` names whose resident KV the prompt may reuse; with `retain` the KV stays
        resident for that owner after the reply ends.

        Raises:
            InvalidRequest, PromptTooLong: the prompt or parameters can never be served.
            ServerBusy: the queue is full. EngineStopped: shutting down.
        """
        params = params or SamplingParams()
        ids = self._check_prompt(prompt_token_ids)
        seq = Sequence(ids, params, owner=owner, retain=retain and owner is not None)
        handle = RequestHandle(seq.seq_id, len(ids), self._cancel)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if self._pending >= self.config.max_queue:
                self.metrics.rejected += 1
                raise ServerBusy(f"server busy: {self._pending} requests are already waiting; "
                                 "try again in a moment")
            self._pending += 1
        self._inbox.put(("submit", _Request(seq, handle, detok)))
        return handle

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | None = None) -> list[list[int]]:
        """Offline helper: submit all prompts at once and return each one's generated ids."""
        handles = [self.submit(p, params) for p in prompts]
        for h in handles:
            h.result()
        return [h.token_ids for h in handles]

    def stats(self) -> EngineStats:
        """A snapshot for the admin page and metrics."""
        m, now = self.metrics, time.monotonic()
        sched = self.scheduler
        running, resident_owners, resident_blocks = self._gauges
        with m.lock:
            return EngineStats(
                running=running, waiting=self._pending,
                blocks_total=self.pool.num_blocks, blocks_used=self.pool.num_used,
                blocks_free=self.pool.num_free, block_size=self.pool.block_size,
                resident_owners=resident_owners, resident_blocks=resident_blocks,
                kv_bytes=self.cache.nbytes, kv_bytes_per_token=self.kv_bytes_per_token,
                model_bytes=self.loaded.model_bytes, max_model_len=self.max_model_len,
                tokens_per_s=m.tokens_per_s(now),
                prompt_tokens_total=m.prompt_tokens, generated_tokens_total=m.generated_tokens,
                ttft_p50_s=percentile(m.ttft, 50), ttft_p95_s=percentile(m.ttft, 95),
                itl_p50_s=percentile(m.itl, 50), itl_p95_s=percentile(m.itl, 95),
                step_ms_p50=percentile(m.step_ms, 50), token_budget=self._last_budget,
                requests_finished=m.finished, requests_failed=m.failed,
                requests_rejected=m.rejected, preemptions=sched.num_preemptions,
                resident_dropped=sched.num_resident_dropped, steps=m.steps,
                max_batch_seen=m.max_batch,
            )

    def queue_position(self, handle: RequestHandle) -> int | None:
        """How many requests wait ahead of this one (None once it runs or ended)."""
        if handle.done:
            return None
        return self._queue_positions.get(handle.seq_id, None if handle.seq_id in
                                         self._running_ids else self._pending - 1)

    def set_memory_pressure_hook(self, hook: Callable[[int, str | None], None] | None) -> None:
        """`hook(blocks_short, protected_owner)` runs on the engine thread when the pool is
        full; it may free resident KV (`export_kv` + `drop_kv`, except the protected owner's)
        before anyone has to wait. It must not block on other threads' locks."""
        self.scheduler.memory_pressure = hook

    def export_kv(self, owner: str) -> KVExport | None:
        """Copy an owner's resident KV to CPU (None if it has none)."""
        def run() -> KVExport | None:
            entry = self.scheduler.resident.get(owner)
            if entry is None:
                return None
            k, v = self.cache.export(entry.block_table, len(entry.token_ids))
            return KVExport(list(entry.token_ids), k, v)
        return self._call(run)

    def import_kv(self, owner: str, kv: KVExport) -> bool:
        """Make exported KV resident for `owner` again; False if the pool cannot hold it."""
        n = len(kv.token_ids)
        shape = (self.loaded.num_layers, n, self.loaded.num_kv_heads, self.loaded.head_dim)
        if n == 0 or tuple(kv.k.shape) != shape or tuple(kv.v.shape) != shape:
            raise InvalidRequest(f"KV of shape {tuple(kv.k.shape)} does not fit this model "
                                 f"(expected {shape})")

        def run() -> bool:
            self.scheduler.drop_resident(owner)
            need = self.pool.blocks_for(n)
            if not self.scheduler._reclaim(need, keep_owner=owner):
                return False
            blocks = self.pool.allocate(need)
            self.cache.load(blocks, kv.k, kv.v)
            self.scheduler.put_resident(owner, ResidentKV(list(kv.token_ids), blocks))
            return True
        return self._call(run)

    def drop_kv(self, owner: str) -> bool:
        """Free an owner's resident KV; True if it had any."""
        return self._call(lambda: self.scheduler.drop_resident(owner))

    def resident_kv(self) -> dict[str, tuple[int, int, float]]:
        """owner -> (tokens, blocks, seconds idle) of every resident KV."""
        def run() -> dict[str, tuple[int, int, float]]:
            now = time.monotonic()
            return {o: (len(e.token_ids), len(e.block_table), now - e.last_used)
                    for o, e in self.scheduler.resident.items()}
        return self._call(run)

    def check_integrity(self) -> None:
        """Assert exact block accounting (runs on the engine thread)."""
        self._call(self.scheduler.check_integrity)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; unfinished requests end with an error."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # -- internals ----------------------------------------------------------------------
    def _check_prompt(self, ids: list[int]) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequest("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest("the prompt contains invalid token ids")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"the prompt is {len(ids)} tokens; this server accepts at most "
                                f"{self.max_model_len - 1} (model length and KV pool)")
        return list(ids)

    def _call(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        fut: Future[T] = Future()
        self._inbox.put(("call", fn, fut))
        return fut.result()

    def _cancel(self, seq_id: int) -> None:
        self._inbox.put(("cancel", seq_id))

    def _handle_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            req: _Request = msg[1]
            self._requests[req.seq.seq_id] = req
            self.scheduler.add(req.seq)
        elif kind == "cancel":
            req = self._requests.get(msg[1])
            if req is not None:
                self._finish(req, FinishReason.CANCELLED)
        elif kind == "call":
            fn, fut = msg[1], msg[2]
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(e)
        elif kind == "stop":
            self._stopping = True

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle_message(msg)
        while True:
            try:
                self._handle_message(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self.scheduler.has_work())
                if not self._stopping and self.scheduler.has_work():
                    self._step()
                self._publish()
        finally:
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.ERROR, "the server is shutting down")
            while True:  # answer what raced with shutdown: calls run, requests fail
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "call":
                    self._handle_message(msg)
                elif msg[0] == "submit":
                    msg[1].handle._finish(FinishReason.ERROR, "the server is shutting down")

    def _step(self) -> None:
        self._last_budget = self._token_budget()
        plan = self.scheduler.schedule(self._last_budget)
        self._count_admitted()
        if not plan:
            self._drain(block=True)  # nothing fits: wait for a cancel or a release
            return
        work = attention_work(plan)
        t0 = time.perf_counter()
        try:
            if self._step_hook is not None:
                self._step_hook(plan)
            next_tokens = self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("model step failed; failing its %d requests", len(plan.decodes)
                          + len(plan.prefills))
            for seq in plan.decodes + [s for s, _ in plan.prefills]:
                req = self._requests.get(seq.seq_id)
                if req is not None:
                    self._finish(req, FinishReason.ERROR, f"generation failed: {e}")
            return
        ms = (time.perf_counter() - t0) * 1000
        self.timer.record(plan.num_tokens, work, ms)
        now = time.monotonic()
        for seq in plan.decodes:
            seq.num_computed += 1
        for seq, n in plan.prefills:
            seq.num_computed += n
        for seq, token in next_tokens.items():
            self._append(self._requests[seq.seq_id], token, now)
        self.metrics.record_step(now, ms, len(plan.decodes) + len(plan.prefills),
                                 len(next_tokens), sum(n for _, n in plan.prefills))

    def _token_budget(self) -> int:
        """The fixed budget, or with --target-itl-ms the one the step timer predicts."""
        if self.config.target_itl_ms is None:
            return self.config.max_num_batched_tokens
        running = self.scheduler.running
        decodes = [s for s in running if s.num_uncomputed == 1]
        pending = [s for s in running if s.num_uncomputed > 1] or list(self.scheduler.waiting)
        return self.timer.budget(len(decodes), sum(s.num_computed + 1 for s in decodes),
                                 pending[0].num_computed if pending else 0)

    def _publish(self) -> None:
        sched = self.scheduler
        self._gauges = (len(sched.running), len(sched.resident),
                        sum(len(e.block_table) for e in sched.resident.values()))
        self._queue_positions = {s.seq_id: i for i, s in enumerate(sched.waiting)}
        self._running_ids = frozenset(s.seq_id for s in sched.running)

    def _count_admitted(self) -> None:
        """Requests that left the queue no longer count against --max-queue."""
        for seq in self.scheduler.running:
            req = self._requests.get(seq.seq_id)
            if req is not None and not req.admitted:
                req.admitted = True
                req.handle.num_cached_tokens = seq.num_computed
                with self._lock:
                    self._pending -= 1

    def _append(self, req: _Request, token: int, now: float) -> None:
        seq, p = req.seq, req.seq.params
        seq.token_ids.append(token)
        req.handle.token_ids.append(token)
        with self.metrics.lock:
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.ttft.append(now - seq.arrival)
                self.metrics.ttft_hist.observe(now - seq.arrival)
            else:
                self.metrics.itl.append(now - seq.last_token_at)
                self.metrics.itl_hist.observe(now - seq.last_token_at)
        seq.last_token_at = now
        reason = None
        if token in self.runner.stop_ids and not p.ignore_eos:
            reason = FinishReason.STOP
        else:
            req.handle._push(req.detok.push(token))
            if req.detok.stopped:
                reason = FinishReason.STOP
            elif seq.num_generated >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: _Request, reason: FinishReason, error: str | None = None) -> None:
        seq = req.seq
        if seq.status is not SequenceStatus.FINISHED:
            if not req.admitted:
                with self._lock:
                    self._pending -= 1
            self.scheduler.remove(seq)
        self._requests.pop(seq.seq_id, None)
        if reason is not FinishReason.ERROR:
            req.handle._push(req.detok.flush())
        with self.metrics.lock:
            if reason is FinishReason.ERROR:
                self.metrics.failed += 1
            else:
                self.metrics.finished += 1
        req.handle._finish(reason, error)
