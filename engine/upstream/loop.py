"""The asyncio loop's side of `UpstreamBackend` (engine.upstream.backend): its HTTP client,
the model discovery at start, the health checks, and one turn served with its retries on the
next replica. A part of `UpstreamBackend`, which sets the attributes declared here."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx

from engine.config import EngineConfig
from engine.errors import EngineStopped, ModelLoadError
from engine.handle import RequestHandle
from engine.metrics import Metrics
from engine.sequence import FinishReason, SamplingParams
from engine.served import ServedTokens
from engine.upstream.net import asyncio_transport
from engine.upstream.routing import Router, probe
from engine.upstream.stream import Outcome, completion_body, stream_turn

log = logging.getLogger("engine.upstream.backend")


class UpstreamLoop:
    """What runs on the backend's event loop (mixed into `UpstreamBackend`)."""

    config: EngineConfig
    router: Router
    metrics: Metrics
    served: ServedTokens
    upstream_model: str
    max_model_len: int
    _client: httpx.AsyncClient
    _lock: threading.Lock
    _pending: int

    async def _make_client(self) -> httpx.AsyncClient:
        # read=None: the first-token and idle timeouts are the turn's own (upstream.stream)
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        return httpx.AsyncClient(timeout=timeout, transport=asyncio_transport(limits))

    async def _discover(self) -> tuple[str, int | None]:
        """The served model's name and context from the first replica's `/v1/models`."""
        deadline, error = time.monotonic() + self.config.upstream_wait_s, "no answer"
        while True:
            for r in self.router.replicas:
                try:
                    got = await self._client.get(f"{r.url}/v1/models", timeout=5.0)
                    got.raise_for_status()
                    model = got.json()["data"][0]
                    return str(model["id"]), model.get("max_model_len")
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                    error = f"{r.url}: {type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise ModelLoadError(f"no --engine-url server answered GET /v1/models ({error})")
            await asyncio.sleep(0.5)

    async def _health_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(
                    *(probe(self._client, self.router, r) for r in self.router.replicas)
                )
            except Exception:  # noqa: BLE001 - the health checks must outlive any one failure
                log.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def _serve(
        self,
        client: httpx.AsyncClient,
        handle: RequestHandle,
        ids: list[int],
        params: SamplingParams,
        key: str,
        user: str,
        salt: str | None,
    ) -> None:
        """Run the turn on its replica; before any token streamed, a failed replica is
        marked down and the next one (by the same hash) gets the turn."""
        tried: set[str] = set()
        try:
            while not handle.done:
                replica = self.router.pick(key, frozenset(tried))
                if replica is None:
                    handle._finish(
                        FinishReason.ERROR,
                        "no model server is reachable right now; try again in a moment",
                        EngineStopped,
                    )
                    break
                tried.add(replica.url)
                # the rate this turn joins: the turns in flight at the recent per-token pace
                itl, streams = self.metrics.recent_itl(), self._pending
                rate = streams / itl if itl else 0.0
                interval = self.config.stream_interval(rate, streams)
                outcome = await stream_turn(
                    client,
                    self.router,
                    replica,
                    handle,
                    completion_body(
                        self.upstream_model, ids, params, self.max_model_len, interval, salt
                    ),
                    self.metrics,
                    (self.config.upstream_first_token_s, self.config.upstream_idle_s),
                )
                if outcome is not Outcome.RETRY:
                    break
        except asyncio.CancelledError:
            handle._finish(FinishReason.CANCELLED)
            raise
        except Exception as e:  # noqa: BLE001 - nobody waits forever on a bug of ours
            log.exception("upstream request failed")
            handle._finish(FinishReason.ERROR, f"the request failed: {e}")
        finally:
            with self._lock:
                self._pending -= 1
            computed = handle.num_prompt_tokens - handle.num_cached_tokens if handle.admitted else 0
            self.served.add(user, computed, handle.num_generated_tokens)
            with self.metrics.lock:
                if handle.finish_reason is FinishReason.ERROR:
                    self.metrics.failed += 1
                else:
                    self.metrics.finished += 1
