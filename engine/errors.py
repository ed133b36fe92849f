"""Errors a user or operator can cause, with messages a person can act on."""

from __future__ import annotations


class CrowdchatError(Exception):
    """Base class of every error crowdchat reports to a user or operator."""


class ModelLoadError(CrowdchatError):
    """The model could not be found or read."""


class InvalidRequest(CrowdchatError):
    """A request's input or parameters are invalid (HTTP 400)."""


class PromptTooLong(InvalidRequest):
    """The prompt can never fit the model's context or the KV pool."""


class ServerBusy(CrowdchatError):
    """The queue is full; the client should retry later (HTTP 429)."""


class EngineStopped(CrowdchatError):
    """The engine is shutting down or has stopped (HTTP 503)."""
