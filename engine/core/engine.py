"""The engine thread: owns the model, the KV pool and the scheduler; others talk to it by queue.

Each step reads as what it is: schedule (`Scheduler`), run (the step runner), process
(`OutputProcessor`). Messages from other threads are the typed ones in `engine.core.messages`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.backend import ConfigFacts
from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.budget import TokenBudget
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.fair_share import make_policy
from engine.core.messages import Call, Cancel, Message, Stop, Submit
from engine.core.output import OutputProcessor, Request
from engine.core.scheduler import Scheduler
from engine.errors import EngineStopped, InvalidRequest, ServerBusy
from engine.handle import RequestHandle
from engine.kv_file import KVExport, KVFile, read_kv_file
from engine.metrics import SERVED_TOP, EngineStats, Metrics, percentile
from engine.model.kv_cache import KVCache, bytes_per_token, pool_blocks
from engine.model.loader import LoadedModel, dtype_name, load_model
from engine.model.plan import StepPlan
from engine.model.runner import ModelRunner, RunnerFactory
from engine.sequence import FinishReason, SamplingParams, Sequence, check_prompt
from engine.threads import run_in_fresh_thread

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5


class Engine(ConfigFacts):
    """One model, one KV pool, one background thread doing continuous batching.

    Thread-safe: `submit`, `cancel` (through the handle), `stats`, the resident-KV calls and
    `shutdown` may be called from any thread; only the engine thread touches the model.
    `runner` makes the step runner from the model and the pool (default: `ModelRunner`); tests
    pass a fake to drive the real scheduler, pool and loop without a model.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        runner: RunnerFactory = ModelRunner,
    ) -> None:
        self.config = config
        self.loaded = loaded or load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.kv_bytes_per_token = bytes_per_token(self.loaded)
        num_blocks = pool_blocks(config, self.loaded)
        # zero-filling is an OpenMP region: keep it off the caller's thread (engine.threads)
        self.cache = run_in_fresh_thread(
            lambda: KVCache(self.loaded, num_blocks, config.block_size)
        )
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, policy=make_policy(config.schedule)
        )
        self.runner = runner(self.loaded, self.cache)
        self.max_model_len = min(
            config.max_model_len or self.loaded.max_position, num_blocks * config.block_size
        )
        self.vocab_size = self.loaded.model.config.vocab_size
        self.metrics = Metrics()
        self.budget = TokenBudget(config.max_num_batched_tokens, config.target_itl_ms)
        self._lock = threading.Lock()  # guards _pending, _stopping, _failure and the inbox's end
        self._pending = 0  # submitted, not yet admitted or finished: the queue the cap limits
        self._stopping = False
        self._failure: str | None = None  # why the engine thread died, if it did
        self._inbox_closed = False  # the thread has drained its inbox for the last time
        self.output = OutputProcessor(
            self.scheduler, self.metrics, self.runner.stop_ids, self.max_model_len, self._left_queue
        )
        self._inbox: queue.Queue[Message] = queue.Queue()
        # Published by the engine thread after each step, read by stats() from any thread.
        self.gauges: tuple[int, int, int] = (0, 0, 0)
        self._queue_positions: dict[int, int] = {}
        self._running_ids: frozenset[int] = frozenset()
        log.info(
            "%s: KV pool: %d blocks x %d tokens = %d tokens, %.1f MB (%s, %d bytes/token); "
            "model %.1f MB",
            self.device_type,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.cache.nbytes / 2**20,
            dtype_name(self.loaded.kv_dtype),
            self.kv_bytes_per_token,
            self.loaded.model_bytes / 2**20,
        )
        self._thread = threading.Thread(target=self._loop, name="crowdchat-engine", daemon=True)
        self._thread.start()

    # -- public API, any thread ---------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        owner: str | None = None,
        retain: bool = False,
        cache_ns: str | None = None,
        shareable_prefix: int = 0,
        user: str | None = None,
    ) -> RequestHandle:
        """Queue a request; stream its reply from the returned handle.

        `owner` names whose resident KV the prompt may reuse; with `retain` the KV stays
        resident for that owner after the reply ends. The prefix cache shares the blocks of
        its first `shareable_prefix` tokens with anyone, and the rest only within `cache_ns`
        (None: the rest is neither looked up nor cached). `user` is whose fair share the work
        is charged to under `--schedule fair` (default: the owner).

        Raises:
            InvalidRequest, PromptTooLong: the prompt or parameters can never be served.
            ServerBusy: the queue is full. EngineStopped: shutting down, or the engine failed.
        """
        params = params or SamplingParams()
        ids = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        seq = Sequence(
            ids,
            params,
            owner=owner,
            retain=retain and owner is not None,
            user=user,
            cache_ns=cache_ns,
            shareable_prefix=max(0, min(int(shareable_prefix), len(ids))),
        )
        handle = RequestHandle(seq.seq_id, len(ids), self._cancel)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        with self._lock:  # held while queueing, so the thread's final drain sees this message
            if self._stopping:
                raise EngineStopped(self._failure or "the server is shutting down")
            if self._pending >= self.config.max_queue:
                self.metrics.rejected += 1
                raise ServerBusy(
                    f"server busy: {self._pending} requests are already waiting; "
                    "try again in a moment"
                )
            self._pending += 1
            self._inbox.put(Submit(Request(seq, handle, detok)))
        return handle

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Offline helper: submit all prompts at once and return each one's generated ids."""
        handles = [self.submit(p, params) for p in prompts]
        for h in handles:
            h.result()
        return [h.token_ids for h in handles]

    # -- facts the session layer, API and pages read (the `Backend` protocol) -------------
    keeps_kv = True  # sessions' KV lives in this pool: export, import, drop, snapshots

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def kv_fingerprint(self) -> dict[str, str | int]:
        return self.loaded.fingerprint(self.config.block_size)

    @property
    def device_type(self) -> str:
        return self.loaded.device.type

    def on_server_loop(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The engine thread does its own work: nothing moves to the web server's loop."""
        return contextlib.nullcontext()

    def drain(self, replica: str, draining: bool = True) -> None:
        """The built-in engine has no replicas to drain."""
        raise InvalidRequest("this server runs its own engine: it has no replicas to drain")

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted or ended (what --max-queue caps)."""
        return self._pending

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (None while it serves)."""
        return self._failure

    @property
    def alive(self) -> bool:
        """False once the engine thread has died (see `stats().failure`) or was shut down."""
        return self._thread.is_alive() and self._failure is None

    def stats(self) -> EngineStats:
        """A consistent snapshot of the gauges and counters for the admin page and metrics
        (any thread)."""
        m, now = self.metrics, time.monotonic()
        running, resident_owners, resident_blocks = self.gauges
        with m.lock:
            return EngineStats(
                running=running,
                waiting=self.num_waiting,
                blocks_total=self.pool.num_blocks,
                blocks_used=self.pool.num_used,
                blocks_free=self.pool.num_free,
                block_size=self.pool.block_size,
                resident_owners=resident_owners,
                resident_blocks=resident_blocks,
                kv_bytes=self.cache.nbytes,
                kv_bytes_per_token=self.kv_bytes_per_token,
                model_bytes=self.loaded.model_bytes,
                max_model_len=self.max_model_len,
                tokens_per_s=m.tokens_per_s(now),
                prompt_tokens_total=m.prompt_tokens,
                generated_tokens_total=m.generated_tokens,
                ttft_p50_s=percentile(m.ttft, 50),
                ttft_p95_s=percentile(m.ttft, 95),
                itl_p50_s=percentile(m.itl, 50),
                itl_p95_s=percentile(m.itl, 95),
                step_ms_p50=percentile(m.step_ms, 50),
                token_budget=self.budget.last,
                requests_finished=m.finished,
                requests_failed=m.failed,
                requests_rejected=m.rejected,
                preemptions=self.scheduler.num_preemptions,
                resident_dropped=self.scheduler.num_resident_dropped,
                steps=m.steps,
                max_batch_seen=m.max_batch,
                blocks_cached=self.pool.num_cached,
                blocks_shared=self.pool.num_shared,
                prefix_cache_queries=self.scheduler.prefix_queries,
                prefix_cache_hits=self.scheduler.prefix_hits,
                schedule=self.scheduler.policy.name,
                kv_dtype=dtype_name(self.loaded.kv_dtype),
                served=tuple(self.scheduler.policy.served_top(SERVED_TOP)),
                alive=self.alive,
                failure=self.failure,
            )

    def queue_position(self, handle: RequestHandle) -> int | None:
        """How many waiting requests the scheduler would admit before this one under its
        policy as it stands (None once it runs or ended)."""
        if handle.done:
            return None
        return self._queue_positions.get(
            handle.seq_id, None if handle.seq_id in self._running_ids else self._pending - 1
        )

    def wait_estimate(self, ahead: int) -> float | None:
        """Seconds until a request with `ahead` requests before it is admitted, at the rate
        requests were admitted lately (None before any was)."""
        rate = self.metrics.admission_rate(time.monotonic())
        return (ahead + 1) / rate if rate else None

    def set_memory_pressure_hook(self, hook: Callable[[int, str | None], None] | None) -> None:
        """`hook(blocks_short, protected_owner)` runs on the engine thread when the pool is
        full; it may free resident KV (`export_kv` + `drop_kv`, except the protected owner's)
        before anyone has to wait. It must not block on other threads' locks."""
        self.scheduler.memory_pressure = hook

    def export_kv(self, owner: str) -> KVExport | None:
        """Copy an owner's resident KV to CPU (None if it has none)."""
        return self._call(lambda: self.scheduler.resident.export(owner, self.cache))

    def import_kv(
        self, owner: str, kv: KVExport, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        """Make exported KV resident for `owner` again; False if the pool cannot hold it.
        Leading blocks the prefix cache holds (as `submit` keys them) are shared, not loaded.
        Raises InvalidRequest if its shape does not fit this model."""
        sched = self.scheduler
        reclaim = lambda need: sched.reclaim(need, keep_owner=owner)  # noqa: E731
        return self._call(
            lambda: sched.resident.load(
                owner, kv, self.cache, reclaim, cache_ns, max(0, shareable_prefix)
            )
        )

    def import_kv_file(
        self, owner: str, kv: KVFile, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        """`import_kv` of KV stored in a file; False if the pool cannot hold it. On a CPU pool
        the file is read on the calling thread straight into blocks the engine thread sets
        aside, so no step waits for the disk. Raises KVFileDamaged for a short, unreadable or
        corrupted file, InvalidRequest as `import_kv`."""
        _, layers, heads, _, dim = self.cache.data.shape
        if kv.shape != (layers, len(kv.token_ids), heads, dim):
            raise InvalidRequest(f"KV of shape {kv.shape} does not fit this model")
        if not self.cache.reads_files(kv):  # read here, copied into the pool by the engine
            k, v = read_kv_file(kv)
            return self.import_kv(owner, KVExport(kv.token_ids, k, v), cache_ns, shareable_prefix)
        sched = self.scheduler
        reclaim = lambda need: sched.reclaim(need, keep_owner=owner)  # noqa: E731
        res = self._call(
            lambda: sched.resident.reserve(
                owner, kv.token_ids, reclaim, cache_ns, max(0, shareable_prefix)
            )
        )
        if res is None:
            return False
        loaded = False
        try:
            self.cache.load_file(res.block_table, kv, res.start)
            loaded = True
        finally:
            resident = self._call(lambda: sched.resident.finish(res, loaded))
        return resident

    def drop_kv(self, owner: str) -> bool:
        """Free an owner's resident KV; True if it had any."""
        return self._call(lambda: self.scheduler.resident.drop(owner))

    def reset_prefix_cache(self) -> int:
        """Forget the KV of every cached block nobody holds (benchmarks measure cold turns
        with it); returns how many blocks were forgotten."""
        return self._call(self.scheduler.pool.forget_cached)

    def resident_kv(self) -> dict[str, tuple[int, int, float]]:
        """owner -> (tokens, blocks, seconds idle) of every resident KV."""
        return self._call(self.scheduler.resident.summary)

    def check_integrity(self) -> None:
        """Assert exact block accounting (runs on the engine thread)."""
        self._call(self.scheduler.check_integrity)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; unfinished requests end with an error."""
        with self._lock:
            self._stopping = True
            self._inbox.put(Stop())
        self._thread.join(timeout)

    # -- internals ----------------------------------------------------------------------
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
                self._drain(block=not self.scheduler.has_work())
                if not self._stopping and self.scheduler.has_work():
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
        """Schedule, run, process."""
        plan = self.scheduler.schedule(self.budget.next(self.scheduler))
        self.output.count_admitted()
        if not plan:
            self._drain(block=True)  # nothing fits: wait for a cancel or a release
            return
        t0 = time.perf_counter()
        next_tokens = self._run(plan)
        if next_tokens is None:
            return
        ms = (time.perf_counter() - t0) * 1000
        self.budget.record(plan, ms)
        now = time.monotonic()
        self.output.process(plan, next_tokens, now)
        self.metrics.record_step(
            now,
            ms,
            len(plan.decodes) + len(plan.prefills),
            len(next_tokens),
            sum(n for _, n in plan.prefills),
        )

    def _run(self, plan: StepPlan) -> dict[Sequence, int] | None:
        """The runner's next tokens, or None when the step failed (and with it its requests)."""
        try:
            return self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("model step failed; failing its %d requests", len(plan.sequences))
            self.output.fail(plan.sequences, f"generation failed: {e}")
            return None

    def _publish(self) -> None:
        sched = self.scheduler
        self.gauges = (len(sched.running), len(sched.resident), sched.resident.num_blocks)
        order = sched.policy.admission_order(sched.waiting) if sched.waiting else []
        self._queue_positions = {s.seq_id: i for i, s in enumerate(order)}
        self._running_ids = frozenset(s.seq_id for s in sched.running)
