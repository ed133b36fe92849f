"""The upstream backend: the same `Backend` protocol over vLLM (or any OpenAI-compatible server
that takes token-id prompts), one replica per URL. No model weights in this process.

One asyncio loop on a thread of its own runs the health checks and, until a web server lends
its loop (`on_server_loop`), every request: no thread per request or per token. Each turn sends
the exact prompt ids crowdchat built (its chat template, its truncation) to `/v1/completions`
with `stream: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx
from transformers import PreTrainedTokenizerBase

from engine.backend import ConfigFacts
from engine.config import EngineConfig
from engine.errors import EngineStopped, ServerBusy
from engine.handle import RequestHandle
from engine.kv_file import KVExport, KVFile
from engine.metrics import SERVED_TOP, EngineStats, Metrics, stream_stats
from engine.model.loader import local_tokenizer
from engine.sequence import SamplingParams, check_prompt
from engine.served import ServedTokens
from engine.upstream.loop import UpstreamLoop
from engine.upstream.routing import Router
from engine.upstream.stream import cache_salt

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request and health check
T = TypeVar("T")


class UpstreamBackend(UpstreamLoop, ConfigFacts):
    """crowdchat's sessions, pages and API over remote engines. Thread-safe like `Engine`."""

    keeps_kv = False  # the upstream's prefix cache (and KV offloading) keeps sessions' KV
    kv_bytes_per_token = 0
    device_type = "upstream"

    def __init__(
        self,
        config: EngineConfig,
        local: tuple[PreTrainedTokenizerBase, str, int, int] | None = None,
    ) -> None:
        self.config = config
        self.router = Router(config.urls())
        self.tokenizer, self._model_id, context, self.vocab_size = local or local_tokenizer(config)
        self.metrics = Metrics()
        self.served = ServedTokens()  # per user, for /metrics and the admin page
        self._lock = threading.Lock()  # guards _pending and _stopping
        self._pending = 0  # requests in flight: --max-num-seqs + --max-queue caps them
        self._stopping = False
        self._ids = itertools.count()
        # the key of the replicas' cache salts (a restart starts their prefix caches afresh)
        self._salt_key = secrets.token_bytes(32)
        self._futures: dict[int, Future] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="crowdchat-upstream", daemon=True
        )
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._make_client())
        # where turns run: this thread's loop, or the web server's while it lends it
        self._requests: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            self._loop,
            self._client,
        )
        try:
            self.upstream_model, upstream_len = self._call(self._discover())
        except BaseException:
            self._call(self._client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.max_model_len = min(config.max_model_len or context, upstream_len or context)
        self._health = asyncio.run_coroutine_threadsafe(self._health_loop(), self._loop)
        log.info(
            "upstream: %s serving %r (context %d) at %s",
            self._model_id,
            self.upstream_model,
            self.max_model_len,
            ", ".join(r.url for r in self.router.replicas),
        )

    # -- facts ----------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def kv_fingerprint(self) -> dict[str, str | int]:
        return {"model_id": self._model_id, "device": "upstream"}

    @property
    def alive(self) -> bool:
        """False once shut down, or while no replica is healthy."""
        return self.failure is None

    @property
    def failure(self) -> str | None:
        if self._stopping or not self._thread.is_alive():
            return "the server is shutting down"
        if not self.router.any_healthy():
            return f"no model server is reachable ({len(self.router.replicas)} replicas down)"
        return None

    # -- requests -------------------------------------------------------------------------
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
        """Send the request to the replica its owner (session) or user hashes to. `retain`
        and `shareable_prefix` are the upstream prefix cache's business; `cache_ns` salts it
        (`cache_salt`)."""
        params = params or SamplingParams()
        ids = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if self._pending >= self.config.max_num_seqs + self.config.max_queue:
                self.metrics.rejected += 1
                raise ServerBusy(
                    f"server busy: {self._pending} requests are in flight; try again in a moment"
                )
            if not self.router.any_healthy():
                raise EngineStopped("no model server is reachable right now; try again in a moment")
            self._pending += 1
        seq_id = next(self._ids)
        handle = RequestHandle(seq_id, len(ids), self._cancel)
        key = owner or user or f"request-{seq_id}"
        loop, client = self._requests
        salt = cache_salt(self._salt_key, cache_ns)
        serve = self._serve(client, handle, ids, params, key, user or owner or "", salt)
        fut = asyncio.run_coroutine_threadsafe(serve, loop)
        self._futures[seq_id] = fut
        fut.add_done_callback(lambda _f: self._futures.pop(seq_id, None))
        return handle

    @contextlib.asynccontextmanager
    async def on_server_loop(self) -> AsyncIterator[None]:
        """While inside, new turns stream on the calling loop (the web server's, which reads
        their handles), with a client of its own: a token then reaches its reader with no
        hop between threads, and one loop instead of two wakes per event (measured: see
        docs/SCALE.md). Turns already started stay where they are."""
        client = await self._make_client()
        self._requests = (asyncio.get_running_loop(), client)
        try:
            yield
        finally:
            self._requests = (self._loop, self._client)
            await client.aclose()

    def stats(self) -> EngineStats:
        return stream_stats(
            self.metrics,
            running=self._pending,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            alive=self.alive,
            failure=self.failure,
            replicas=self.router.stats(),
            served=tuple(self.served.top(SERVED_TOP)),
        )

    def queue_position(self, handle: RequestHandle) -> int | None:
        """The upstream's queue is its own: not known per request."""
        return None

    def wait_estimate(self, ahead: int) -> float | None:
        return None

    def recompute_s(self, tokens: int) -> float | None:
        return None  # the upstream keeps its own KV: nothing to weigh here

    def read_s(self, nbytes: int) -> float | None:
        return None

    def drain(self, replica: str, draining: bool = True) -> None:
        self.router.drain(replica, draining)

    # -- KV: the upstream keeps it (prefix cache, offloading); nothing to move here -------
    def set_memory_pressure_hook(self, hook: Callable[[int, str | None], None] | None) -> None:
        return None

    def resident_kv(self) -> dict[str, tuple[int, int, float]]:
        return {}

    def export_kv(self, owner: str) -> KVExport | None:
        return None

    def import_kv(
        self, owner: str, kv: KVExport, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        return False

    def import_kv_file(
        self, owner: str, kv: KVFile, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool:
        return False

    def drop_kv(self, owner: str) -> bool:
        return False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel what is in flight (closing its upstream streams), then stop the loop."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        for fut in list(self._futures.values()):
            fut.cancel()
        self._health.cancel()
        try:
            self._call(self._client.aclose(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    # -- the loop's side ------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _cancel(self, seq_id: int) -> None:
        fut = self._futures.get(seq_id)
        if fut is not None:
            fut.cancel()  # cancels the task; leaving `client.stream` closes the connection
