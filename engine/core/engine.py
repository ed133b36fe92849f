"""The engine thread: owns the model, the KV pool and the scheduler; others talk to it by queue.

Each step reads as what it is: schedule (`Scheduler`), run (the step runner), process
(`OutputProcessor`). Messages from other threads are the typed ones in `engine.core.messages`.
`Engine` is built of three parts: this module (construction, `submit`, the facts and gauges
any thread reads), `engine.core.loop` (the thread itself) and `engine.core.kv_calls` (resident
KV in and out of the pool for the session layer).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.backend import ConfigFacts
from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.budget import TokenBudget
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.fair_share import make_policy
from engine.core.kv_calls import ResidentKVCalls
from engine.core.loop import EngineLoop
from engine.core.messages import Message, Stop, Submit
from engine.core.output import OutputProcessor, Request
from engine.core.scheduler import Scheduler
from engine.errors import EngineStopped, InvalidRequest, ServerBusy
from engine.handle import RequestHandle
from engine.kv_file import ReadPace
from engine.metrics import SERVED_TOP, EngineStats, Metrics, percentile
from engine.model.kv_cache import KVCache, bytes_per_token, pool_blocks
from engine.model.loader import LoadedModel, dtype_name, load_model
from engine.model.runner import ModelRunner, RunnerFactory
from engine.sequence import SamplingParams, Sequence, check_prompt
from engine.startup import Startup
from engine.threads import run_in_fresh_thread

log = logging.getLogger(__name__)


class Engine(ResidentKVCalls, EngineLoop, ConfigFacts):
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
        startup: Startup | None = None,
    ) -> None:
        self.config = config
        startup = startup or Startup()
        self.loaded = loaded or load_model(config, startup)
        self.tokenizer = self.loaded.tokenizer
        self.kv_bytes_per_token = bytes_per_token(self.loaded)
        with startup.step("sizing the KV pool"):
            num_blocks = pool_blocks(config, self.loaded)
            # zero-filling is an OpenMP region: keep it off the caller's thread (engine.threads)
            scratch = bool(self.loaded.decode_buckets)  # one block of the budget kept aside
            self.cache = run_in_fresh_thread(
                lambda: KVCache(self.loaded, num_blocks, config.block_size, scratch=scratch)
            )
            num_blocks -= scratch
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, policy=make_policy(config.schedule)
        )
        # before the runner: its static decode's tables are this wide (engine.model.static_decode)
        self.max_model_len = min(
            config.max_model_len or self.loaded.max_position, num_blocks * config.block_size
        )
        self.runner = runner(self.loaded, self.cache, self.max_model_len)
        self.vocab_size = self.loaded.model.config.vocab_size
        self.metrics = Metrics()
        self.budget = TokenBudget(config.max_num_batched_tokens, config.target_itl_ms)
        self.read_pace = ReadPace()
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
        self._running_seen = 0
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
            if params.stop:  # stop strings: the engine thread must see them before the next step
                self._inbox.put(Submit(Request(seq, handle, detok)))
            else:  # the reader decodes its own text, off the engine thread
                handle._detok = detok
                self._inbox.put(Submit(Request(seq, handle, None)))
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
                **m.served(now),
                step_ms_p50=percentile(m.step_ms, 50),
                token_budget=self.budget.last,
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
                graph_bytes=getattr(self.runner, "graph_bytes", 0),
                cuda_graphs=getattr(self.runner, "graphs_captured", 0),
                cuda_graph_error=getattr(self.runner, "graph_error", None),
                runs_ahead=getattr(self.runner, "runs_ahead", False),
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

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds to prefill `tokens` of a conversation from nothing at the pace of recent
        steps (None before enough were timed): the session layer weighs a disk read by it."""
        return self.budget.recompute_s(tokens)

    def set_memory_pressure_hook(self, hook: Callable[[int, str | None], None] | None) -> None:
        """`hook(blocks_short, protected_owner)` runs on the engine thread when the pool is
        full; it may free resident KV (`export_kv` + `drop_kv`, except the protected owner's)
        before anyone has to wait. It must not block on other threads' locks."""
        self.scheduler.memory_pressure = hook

    def check_integrity(self) -> None:
        """Assert exact block accounting (runs on the engine thread)."""
        self._call(self.scheduler.check_integrity)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; unfinished requests end with an error."""
        with self._lock:
            self._stopping = True
            self._inbox.put(Stop())
        self._thread.join(timeout)
