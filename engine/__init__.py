"""crowdchat's engine: one shared model, a paged KV pool, continuous batching in a thread."""

from __future__ import annotations

from engine.threads import prefer_passive_omp_waits

prefer_passive_omp_waits()  # before anything below loads torch (and with it libgomp)

from engine.backend import Backend
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.errors import (
    CrowdchatError,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    PromptTooLong,
    ServerBusy,
)
from engine.handle import RequestFailed, RequestHandle
from engine.kv_file import (
    KVExport,
    KVFile,
    KVFileDamaged,
    kv_crc32,
    kv_file_bytes,
    read_kv_file,
)
from engine.metrics import EngineStats
from engine.model.runner import StepRunner
from engine.sequence import FinishReason, SamplingParams
from engine.startup import Startup


def open_backend(config: EngineConfig, startup: Startup | None = None) -> Backend:
    """The upstream backend with --engine-url, else the built-in engine (loads the model,
    telling `startup` each step)."""
    if config.urls():
        from engine.upstream.backend import UpstreamBackend

        return UpstreamBackend(config)
    from engine.core.engine import Engine

    return Engine(config, startup=startup)


# What the rest of crowdchat may use; everything else in engine/ is the engine's own.
__all__ = [
    "Backend",
    "CrowdchatError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "EngineStopped",
    "FinishReason",
    "InvalidRequest",
    "KVExport",
    "KVFile",
    "KVFileDamaged",
    "ModelLoadError",
    "PromptTooLong",
    "RequestFailed",
    "RequestHandle",
    "SamplingParams",
    "ServerBusy",
    "Startup",
    "StepRunner",
    "kv_crc32",
    "kv_file_bytes",
    "open_backend",
    "read_kv_file",
]
