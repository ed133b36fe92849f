"""Engines and session managers over an already loaded model, for tests and the test servers
(tests/web.py); tests/conftest.py re-exports them beside its fixtures."""

from __future__ import annotations

from pathlib import Path

from engine import Engine, EngineConfig
from engine.chat_format import ChatFormatter
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner, RunnerFactory


def make_engine(
    loaded: LoadedModel, tmp: Path, runner: RunnerFactory = ModelRunner, **overrides: object
) -> Engine:
    """An engine over an already loaded model (small pool unless overridden)."""
    settings: dict[str, object] = {"data_dir": tmp, "kv_budget_mb": 64}
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded, runner=runner)  # type: ignore[arg-type]


def ask(formatter: ChatFormatter, text: str) -> list[int]:
    """One user message in the chat template, as token ids."""
    return formatter.encode([{"role": "user", "content": text}])


def make_sessions(
    loaded: LoadedModel,
    data_dir: Path,
    engine_overrides: dict | None = None,
    **session_overrides: object,
):  # noqa: ANN201 - (Engine, SessionManager)
    """An engine plus a session manager on `data_dir` (idle persistence off unless asked)."""
    from sessions import SessionConfig, SessionManager

    engine = make_engine(loaded, data_dir, **(engine_overrides or {}))
    settings: dict[str, object] = {"idle_seconds": 3600.0}
    settings.update(session_overrides)
    manager = SessionManager(engine, SessionConfig(**settings), data_dir)  # type: ignore[arg-type]
    return engine, manager


def close_sessions(engine: Engine, manager: object) -> None:
    manager.shutdown()  # type: ignore[attr-defined]
    engine.check_integrity()
    engine.shutdown()
