"""Gradio's queue polls for work at 50 Hz, not 1 kHz (ui.queue_polling)."""

from __future__ import annotations

import gradio as gr

from ui.queue_polling import IDLE_POLL_S, PROGRESS_POLL_S, poll_less


def test_a_pages_queue_polls_less() -> None:
    with gr.Blocks() as demo:
        gr.Markdown("hi")
    demo.queue(default_concurrency_limit=4)
    queue = demo._queue
    assert queue.sleep_when_free < IDLE_POLL_S  # Gradio's own: 1 ms (Windows: 50 ms)
    assert poll_less(demo)
    assert queue.sleep_when_free == IDLE_POLL_S
    assert queue.progress_update_sleep_when_free == PROGRESS_POLL_S


def test_a_gradio_without_the_settings_keeps_its_own() -> None:
    class Bare:
        _queue = object()

    assert not poll_less(Bare())  # type: ignore[arg-type]


def test_the_servers_chat_and_admin_pages_poll_less(nf4_model, tmp_path) -> None:
    from app import AppConfig, build_app
    from tests.conftest import close_sessions, make_sessions
    from tests.web import ADMIN_PASSWORD
    from ui.pages import gradio_app

    engine, sessions = make_sessions(nf4_model, tmp_path)
    try:
        app, monitor = build_app(
            engine, sessions, AppConfig(admin_password=ADMIN_PASSWORD), tmp_path
        )
        monitor.stop()
        for path in ("", "/admin"):
            queue = gradio_app(app, path).get_blocks()._queue
            assert queue.sleep_when_free == IDLE_POLL_S, path
            assert queue.progress_update_sleep_when_free == PROGRESS_POLL_S, path
    finally:
        close_sessions(engine, sessions)
