"""The session layer's frozen configuration; its fields define flags and CROWDCHAT_* overrides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from engine.errors import InvalidRequest
from engine.settings import Settings, setting


@dataclass(frozen=True)
class SessionConfig(Settings):
    """When idle sessions leave the pool, where they go, and per-turn limits."""

    section: ClassVar[str] = "sessions"

    idle_seconds: float = setting(120.0, "an idle session's KV goes to disk after this long")
    kv_host_budget_mb: float = setting(
        1024.0, "CUDA only: pinned host RAM tier for idle KV before disk"
    )
    kv_disk_budget_mb: float = setting(
        4096.0, "snapshot files beyond this are deleted, oldest first"
    )
    # How often the sweeper looks for idle sessions; tests shorten it, operators need not.
    sweep_interval_s: float = setting(1.0, "seconds between idle sweeps", cli=False)
    max_message_chars: int = setting(32_000, "longest accepted message")
    max_import_mb: float = setting(
        32.0,
        "largest conversations file accepted for import (the page's upload and "
        "POST /v1/sessions/import); its messages may be 10x --max-message-chars",
    )
    max_tokens_per_turn: int = setting(2048, "longer reply requests are clamped to this")
    tokens_per_minute: int = setting(
        20_000, "per-user budget of new prompt + generated tokens (0: off)"
    )
    # An app's backend sends many people's turns as one client; where it names them (the
    # `user` field, --end-user-header) each has the per-user budget and this caps their sum,
    # so a new name per request buys at most this. The crowd of bench/crowd.py at 4.5
    # conversations/s computes ~30,000 tokens a minute from one address.
    tokens_per_minute_per_client: int = setting(
        100_000,
        "budget of new prompt + generated tokens per client (an address of the open API, an "
        "API key, a browser), all the end users it names together (0: off)",
    )
    max_turns_per_user: int = setting(4, "conversations answering at once per user (0: no cap)")
    # beyond the batch they wait in the engine's queue, which fair share orders across users,
    # so one identity's many requests (an app serving its own users) wait behind others' few
    # instead of being refused (as llama-server and vLLM queue them); half the default queue
    max_requests_per_user: int = setting(
        128,
        "requests queued or answering per user, turns and one-off completions; beyond: HTTP 429"
        " with Retry-After (0: no cap)",
    )
    max_sessions_per_user: int = setting(200, "conversations kept per user (0: no cap)")
    max_storage_mb_per_user: float = setting(
        100.0,
        "MB of text kept per user: messages (imported ones too) and share links' copies; "
        "beyond, new messages, imports and links get HTTP 429 (0: no cap)",
    )
    max_pending_creates: int = setting(
        16, "conversations being created at once, all users together (0: no cap)"
    )
    max_pending_creates_per_user: int = setting(
        2, "conversations being created at once per user (0: no cap)"
    )
    max_messages_per_request: int = setting(
        256, "messages in one request of a whole conversation (API without a session)"
    )
    shared_system_prompt: Path | None = setting(
        None,
        "a text file: the system prompt of conversations without their own, whose KV all "
        "users share (prefilled once); off: only the template's default is shared",
    )

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(f"invalid session setting: {msg}")

        need(self.idle_seconds >= 0, "--idle-seconds must be >= 0")
        need(self.kv_host_budget_mb >= 0, "--kv-host-budget-mb must be >= 0")
        need(self.kv_disk_budget_mb >= 0, "--kv-disk-budget-mb must be >= 0")
        need(self.sweep_interval_s > 0, "the sweep interval must be > 0")
        need(self.max_message_chars >= 1, "--max-message-chars must be >= 1")
        need(self.max_import_mb > 0, "--max-import-mb must be > 0")
        need(self.max_tokens_per_turn >= 1, "--max-tokens-per-turn must be >= 1")
        need(self.tokens_per_minute >= 0, "--tokens-per-minute must be >= 0 (0: off)")
        need(
            self.tokens_per_minute_per_client >= 0,
            "--tokens-per-minute-per-client must be >= 0 (0: off)",
        )
        for name in (
            "max_turns_per_user",
            "max_requests_per_user",
            "max_sessions_per_user",
            "max_pending_creates",
            "max_pending_creates_per_user",
            "max_storage_mb_per_user",
        ):
            flag = "--" + name.replace("_", "-")
            need(getattr(self, name) >= 0, f"{flag} must be >= 0 (0: no cap)")
        need(self.max_messages_per_request >= 1, "--max-messages-per-request must be >= 1")
        if self.shared_system_prompt is not None:
            object.__setattr__(self, "shared_system_prompt", Path(self.shared_system_prompt))
            need(
                self.shared_system_prompt.is_file(),
                f"--shared-system-prompt file not found: {self.shared_system_prompt}",
            )

    def shared_system_text(self) -> str:
        """The operator's shared system prompt ('' when none is configured)."""
        if self.shared_system_prompt is None:
            return ""
        try:
            return self.shared_system_prompt.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"--shared-system-prompt cannot be read: {e}") from None
