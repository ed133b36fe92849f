"""crowdchat's HTTP API: OpenAI-compatible chat completions and Prometheus metrics.

Others use the two routers; the rest (request parsing, the error table) serves them."""

from __future__ import annotations

from api.metrics import build_metrics_router
from api.openai_api import build_router

__all__ = ["build_metrics_router", "build_router"]
