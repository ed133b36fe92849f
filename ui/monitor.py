"""What the admin page shows: device memory, engine and session figures, and their history."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import psutil
import torch

from engine import Backend
from sessions import SessionManager

HISTORY_S = 600  # ten minutes of time series
SAMPLE_S = 2.0


@dataclass(frozen=True)
class Memory:
    """Device memory split into parts that add up to `total` (bytes)."""

    device: str
    total: int
    model: int
    kv_used: int
    kv_free: int
    other: int
    free: int
    detail: dict[str, int]


def memory(engine: Backend) -> Memory:
    """VRAM from torch on CUDA; RAM from psutil on CPU."""
    s = engine.stats()
    block_bytes = s.kv_bytes_per_token * s.block_size
    kv_used = s.blocks_used * block_bytes
    kv_free = s.kv_bytes - kv_used
    if engine.device_type == "cuda":
        dev = torch.device("cuda")
        free, total = torch.cuda.mem_get_info(dev)
        detail = {
            "allocated": torch.cuda.memory_allocated(dev),
            "reserved": torch.cuda.memory_reserved(dev),
            "cuda_graphs": s.graph_bytes,  # within reserved: the captured decode steps' pool
        }
        other = max(total - free - s.model_bytes - s.kv_bytes, 0)
        return Memory(
            f"cuda ({torch.cuda.get_device_name(dev)})",
            total,
            s.model_bytes,
            kv_used,
            kv_free,
            other,
            free,
            detail,
        )
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    other = max(vm.total - vm.available - s.model_bytes - s.kv_bytes, 0)
    return Memory(
        "cpu (RAM)" if engine.device_type == "cpu" else "this host (RAM; the model runs upstream)",
        vm.total,
        s.model_bytes,
        kv_used,
        kv_free,
        other,
        vm.available,
        {"process_rss": rss, "system_available": vm.available},
    )


class Monitor:
    """Samples the engine every couple of seconds so every admin view shares one history."""

    def __init__(self, engine: Backend, sessions: SessionManager) -> None:
        self.engine = engine
        self.sessions = sessions
        self.samples: deque[dict[str, float]] = deque(maxlen=int(HISTORY_S / SAMPLE_S))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crowdchat-monitor", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        s = self.engine.stats()
        row = {
            "time": time.time(),
            "batch": s.running,
            "queue": s.waiting,
            "tokens_per_s": round(s.tokens_per_s, 1),
            "kv_blocks_used": s.blocks_used,
            "kv_used_frac": s.blocks_used / max(s.blocks_total, 1),
            "ttft_p50_s": s.ttft_p50_s or 0.0,
        }
        self.samples.append(row)
        return row

    def warnings(self) -> list[str]:
        """Capacity hints from the last 30 seconds."""
        recent = [r for r in self.samples if r["time"] >= time.time() - 30]
        out = []
        if len(recent) >= 5 and min(r["kv_used_frac"] for r in recent) > 0.9:
            out.append(
                "KV pool above 90% for 30 s: idle sessions are being evicted; lower "
                "--max-num-seqs, quantize harder or add memory."
            )
        if len(recent) >= 5 and min(r["queue"] for r in recent) > 0:
            out.append(
                "Requests have been queueing for 30 s: the server is at capacity; "
                "raise the KV budget or add capacity."
            )
        st = self.sessions.stats()
        engine = self.engine.stats()
        if not engine.alive:
            out.append(
                f"ENGINE DOWN: {engine.failure or 'stopped'}. Every request fails "
                "until the server restarts."
            )
        if not st.kv_writer_healthy:
            out.append(
                f"KV writer unhealthy ({st.kv_writer_restarts} restarts): evicted "
                "sessions' KV is not reaching the disk; see the log."
            )
        if st.last_snapshot_error:
            out.append(f"Snapshot error: {st.last_snapshot_error}")
        for sid, why in list(st.persist_backoff.items())[:5]:
            out.append(f"Session {sid[:8]} cannot be persisted: {why}")
        if st.restore_errors:
            out.append(
                f"{st.restore_errors} restore(s) failed unexpectedly (the sessions "
                f"recomputed); last: {st.last_restore_error}"
            )
        return out

    def fits(self, tokens: int) -> int:
        """How many conversations of `tokens` tokens the pool holds at once."""
        s = self.engine.stats()
        return s.blocks_total // max(1, -(-int(tokens) // s.block_size))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.sample()
            except Exception:  # noqa: BLE001,S110 - a missed sample is harmless
                pass
