"""crowdchat's engine: one shared model, a paged KV pool, continuous batching in a thread."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine, KVExport
from engine.errors import (
    CrowdchatError,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    PromptTooLong,
    ServerBusy,
)
from engine.handle import RequestFailed, RequestHandle
from engine.sequence import FinishReason, SamplingParams

__all__ = [
    "CrowdchatError", "Engine", "EngineConfig", "EngineStopped", "FinishReason",
    "InvalidRequest", "KVExport", "ModelLoadError", "PromptTooLong", "RequestFailed",
    "RequestHandle", "SamplingParams", "ServerBusy",
]
