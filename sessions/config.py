"""The session layer's frozen configuration, built from flags with CROWDCHAT_* overrides."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config import env_default, from_namespace
from engine.errors import InvalidRequest


@dataclass(frozen=True)
class SessionConfig:
    """When idle sessions leave the pool, where they go, and per-turn limits."""

    idle_seconds: float = 120.0
    kv_host_budget_mb: float = 1024.0  # CUDA only: pinned host RAM tier before disk
    kv_disk_budget_mb: float = 4096.0
    sweep_interval_s: float = 1.0
    max_message_chars: int = 32_000
    max_tokens_per_turn: int = 2048  # longer requests are clamped to this
    tokens_per_minute: int = 20_000  # per user; 0 turns the limit off

    def __post_init__(self) -> None:
        for name in ("idle_seconds", "kv_host_budget_mb", "kv_disk_budget_mb"):
            if getattr(self, name) < 0:
                raise InvalidRequest(f"invalid session setting: --{name.replace('_', '-')} "
                                     "must be >= 0")
        if self.sweep_interval_s <= 0 or self.max_message_chars < 1 \
                or self.max_tokens_per_turn < 1 or self.tokens_per_minute < 0:
            raise InvalidRequest("invalid session setting: intervals and limits must be > 0")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("sessions")
        g.add_argument("--idle-seconds", type=float, default=env_default("idle_seconds", 120),
                       help="persist a session's KV to disk after this long idle")
        g.add_argument("--kv-host-budget-mb", type=float,
                       default=env_default("kv_host_budget_mb", 1024),
                       help="CUDA: host RAM for idle sessions' KV before it goes to disk")
        g.add_argument("--kv-disk-budget-mb", type=float,
                       default=env_default("kv_disk_budget_mb", 4096),
                       help="snapshot files beyond this are deleted, oldest first")
        g.add_argument("--max-message-chars", type=int,
                       default=env_default("max_message_chars", 32_000))
        g.add_argument("--max-tokens-per-turn", type=int,
                       default=env_default("max_tokens_per_turn", 2048),
                       help="replies longer than this are cut (requests are clamped)")
        g.add_argument("--tokens-per-minute", type=int,
                       default=env_default("tokens_per_minute", 20_000),
                       help="per-user budget of new prompt + generated tokens (0: off)")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SessionConfig:
        return from_namespace(cls, ns)
