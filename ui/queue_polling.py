"""Gradio's event queue, polled at 50 Hz instead of 1 kHz.

Gradio's queue waits for work by polling: with nothing to do, its processing loop sleeps 1 ms
and looks again, and its progress loop every 10 ms (`Queue.sleep_when_free`,
`progress_update_sleep_when_free`). That is ~1,100 event-loop wake-ups a second per page, idle
or not: measured on the 2-core AMD EPYC, an idle crowdchat used 7% of a core, and each wake-up
can preempt one of the engine's OpenMP threads in the middle of a parallel region, which then
waits for it. Polling every 20 ms (and 200 ms for progress bars, which these pages do not use)
costs a chat event at most 20 ms before it starts, next to a reply's hundreds of milliseconds.
"""

from __future__ import annotations

import logging

import gradio as gr

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02
PROGRESS_POLL_S = 0.2


def poll_less(blocks: gr.Blocks) -> bool:
    """Slow the idle polling of `blocks`' queue (call after `blocks.queue(...)`, which makes a
    new one). Returns whether this Gradio has the settings (else it keeps its own)."""
    queue = getattr(blocks, "_queue", None)
    names = ("sleep_when_free", "progress_update_sleep_when_free")
    if queue is None or not all(isinstance(getattr(queue, n, None), float) for n in names):
        log.warning("this Gradio's queue has no polling settings: it keeps its own")
        return False
    queue.sleep_when_free = max(queue.sleep_when_free, IDLE_POLL_S)
    queue.progress_update_sleep_when_free = max(
        queue.progress_update_sleep_when_free, PROGRESS_POLL_S
    )
    return True
