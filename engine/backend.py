"""The engine seam: everything sessions/, api/, ui/ and app.py use of an engine, as one protocol.

Two backends implement it: the built-in `Engine` (the model in this process) and
`UpstreamBackend` (vLLM or another OpenAI-compatible server per replica). Callers branch on
what the protocol says (`keeps_kv`, `stats().replicas`), never on which backend it is.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.handle import RequestHandle
from engine.kv_file import KVExport, KVFile
from engine.metrics import EngineStats, Metrics
from engine.sequence import SamplingParams


@runtime_checkable
class Backend(Protocol):
    """What the rest of crowdchat may ask of an engine.

    Facts: `tokenizer` (its chat template builds every prompt), `max_model_len`, `model_id`
    (the name /v1/models shows), `max_num_seqs` and `max_queue` (the page's concurrency and
    queue), `block_size` and `kv_bytes_per_token` (the admin page's memory figures),
    `kv_fingerprint` and `device_type` (what snapshots must match, whether host copies are
    pinned), `metrics` (latency histograms for /metrics).

    `keeps_kv`: whether this backend holds sessions' KV where crowdchat can export, import
    and drop it. Without it (an upstream server keeps KV in its own prefix cache) the KV calls
    are no-ops (`resident_kv` empty, `export_kv` None, `import_kv` and `import_kv_file` False)
    and the session layer takes no snapshots: the conversation in SQLite is the truth and is
    sent whole every turn.
    """

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    kv_bytes_per_token: int
    metrics: Metrics

    @property
    def model_id(self) -> str: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def keeps_kv(self) -> bool: ...
    @property
    def kv_fingerprint(self) -> dict[str, str | int]: ...
    @property
    def device_type(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def failure(self) -> str | None: ...

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
        """Start a request; stream its text deltas from the handle (cancel() stops it).
        `owner` (a session id) also picks where it runs; `user` is whose share it costs."""
        ...

    def stats(self) -> EngineStats: ...
    def queue_position(self, handle: RequestHandle) -> int | None: ...
    def wait_estimate(self, ahead: int) -> float | None: ...
    def recompute_s(self, tokens: int) -> float | None:
        """Seconds a prefill of `tokens` from nothing would take now (None: not known)."""
        ...

    def read_s(self, nbytes: int) -> float | None:
        """Seconds reading `nbytes` of a KV snapshot into the pool takes (None: not known)."""
        ...

    def set_memory_pressure_hook(self, hook: Callable[[int, str | None], None] | None) -> None: ...
    def resident_kv(self) -> dict[str, tuple[int, int, float]]: ...
    def export_kv(self, owner: str) -> KVExport | None: ...
    def import_kv(
        self, owner: str, kv: KVExport, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool: ...
    def import_kv_file(
        self, owner: str, kv: KVFile, cache_ns: str | None = None, shareable_prefix: int = 0
    ) -> bool: ...
    def drop_kv(self, owner: str) -> bool: ...

    def on_server_loop(self) -> AbstractAsyncContextManager[None]:
        """Entered by the web server on its event loop for as long as it serves: a backend
        whose requests are asyncio I/O runs them there, next to their readers."""
        ...

    def drain(self, replica: str, draining: bool = True) -> None:
        """Move new turns off a replica (its url) or back on; InvalidRequest where there
        are no replicas (the built-in engine) or no such replica."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


class ConfigFacts:
    """The protocol's facts that both backends read straight from their `EngineConfig`."""

    config: EngineConfig

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_queue(self) -> int:
        return self.config.max_queue

    @property
    def block_size(self) -> int:
        return self.config.block_size
