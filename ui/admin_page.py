"""The admin page: memory, batch, queue, sessions, live; behind the admin credential."""

from __future__ import annotations

import gradio as gr

from engine import CrowdchatError
from engine.metrics import EngineStats
from sessions import SessionManager, SessionStats
from ui.admin_tables import (
    MB,
    replicas_table,
    series,
    served_table,
    sessions_table,
    zone_note,
)
from ui.monitor import Monitor, memory
from ui.queue_polling import poll_less
from ui.shared_prompts_section import build_shared_prompts
from ui.users_admin import UsersAdmin, build_users_section

REFRESH_S = 1.5
PARTS = (
    ("model", "Model weights", "#6366f1"),
    ("kv_used", "KV used", "#f97316"),
    ("kv_free", "KV free", "#fdba74"),
    ("other", "Other", "#94a3b8"),
    ("free", "Free", "#e2e8f0"),
)


def memory_bar(monitor: Monitor) -> str:
    """A stacked bar of device memory, with the figures under it (upstream: this host's)."""
    m = memory(monitor.engine)
    segs, legend = [], []
    for key, label, color in PARTS:
        value = getattr(m, key)
        pct = 100 * value / m.total if m.total else 0
        segs.append(f'<div title="{label}" style="width:{pct:.3f}%;background:{color}"></div>')
        legend.append(
            f'<span class="cc-key"><i style="background:{color}"></i>{label} '
            f"<b>{value / MB:,.1f} MB</b></span>"
        )
    detail = " · ".join(f"{k.replace('_', ' ')} {v / MB:,.0f} MB" for k, v in m.detail.items())
    return (
        f'<div class="cc-mem"><div class="cc-title">Device memory: {m.device}, '
        f'{m.total / MB:,.0f} MB total</div><div class="cc-bar">{"".join(segs)}</div>'
        f'<div class="cc-legend">{"".join(legend)}</div><div class="cc-detail">{detail}'
        f"</div></div>"
    )


def prefix_hit_rate(s: EngineStats) -> str:
    """Prompt tokens whose KV was already there, over all prompt tokens admitted."""
    if not s.prefix_cache_queries:
        return "–"
    return f"{100 * s.prefix_cache_hits / s.prefix_cache_queries:.1f}%"


def pool_lines(s: EngineStats, monitor: Monitor, length: float) -> list[str]:
    """The KV pool's figures, or (upstream) where the KV lives instead."""
    if s.replicas:
        up = sum(r.healthy for r in s.replicas)
        return [
            f"**KV pool** upstream: {up}/{len(s.replicas)} replicas healthy; each keeps "
            "sessions' KV in its own prefix cache (see the replicas table)"
        ]
    return [
        f"**KV pool** {s.blocks_used}/{s.blocks_total} blocks of {s.block_size} tokens "
        f"({s.kv_bytes / MB:,.0f} MB, {s.kv_dtype}, {s.kv_bytes_per_token:,} bytes/token) · "
        f"resident sessions {s.resident_owners}",
        f"**Prefix cache** hit rate {prefix_hit_rate(s)} of {s.prefix_cache_queries:,} prompt "
        f"tokens · **blocks shared** {s.blocks_shared} · cached, free {s.blocks_cached}",
        f"**Capacity**: {monitor.fits(int(length))} conversations of {int(length)} tokens fit "
        f"in the pool at once.",
    ]


def read_pace(st: SessionStats) -> str:
    return "" if st.disk_read_mb_s is None else f" (read at {st.disk_read_mb_s:,.0f} MB/s)"


def chosen(st: SessionStats) -> str:
    """Recomputes that left a snapshot unread, where any did."""
    return f" ({st.recomputes_chosen} faster than the disk)" if st.recomputes_chosen else ""


def totals(monitor: Monitor, sessions: SessionManager, length: float) -> str:
    s = monitor.engine.stats()
    st = sessions.stats()
    lines = [
        f"**Batch** {s.running} running · **queue** {s.waiting} ({s.schedule}) · **tokens/s** "
        f"{s.tokens_per_s:.1f} · **TTFT p50** {fmt(s.ttft_p50_s)} · **ITL p50** "
        f"{fmt(s.itl_p50_s)} p95 {fmt(s.itl_p95_s)}",
        *pool_lines(s, monitor, length),
        f"**Snapshots on disk** {st.snapshots} · {st.snapshot_bytes / MB:,.1f} MB "
        f"of {st.disk_budget_bytes / MB:,.0f} MB budget · host tier {st.host_bytes / MB:,.1f} MB",
        f"**Restores** disk {st.restores['disk']}{read_pace(st)} · host "
        f"{st.restores['host']} · **recomputes** {st.recomputes}{chosen(st)} · **persists** "
        f"{st.persists} "
        f"(failed {st.persist_failures}) · **preemptions** {s.preemptions} · **rejections** "
        f"{s.requests_rejected} · **finished** {s.requests_finished} · **failed** "
        f"{s.requests_failed}",
        "**Refused by per-user limits** "
        + (" · ".join(f"{k} {v}" for k, v in sorted(st.refused_by.items()) if v) or "none"),
    ]
    warns = monitor.warnings()
    if warns:
        lines.append("\n".join(f"> **Warning:** {w}" for w in warns))
    return "\n\n".join(lines)


def fmt(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def build_admin_blocks(
    monitor: Monitor, sessions: SessionManager, users: UsersAdmin | None = None
) -> gr.Blocks:
    """The live admin page (refreshes every 1.5 s); `users`: its Users section (--auth)."""
    plots = {
        "Batch and queue": ["batch", "queue"],
        "Generated tokens/s": ["tokens_per_s"],
        "KV blocks used": ["kv_blocks_used"],
        "TTFT p50 (s)": ["ttft_p50_s"],
    }

    def refresh(length: float):  # noqa: ANN202
        facts = sessions.facts()
        named = [f"user:{n}" for n in users.users.all()] if users is not None else []
        owners = named + [f.owner for f in facts]
        samples = list(monitor.samples)
        return (
            memory_bar(monitor),
            totals(monitor, sessions, length),
            *(series(samples, cols) for cols in plots.values()),
            sessions_table(facts),
            served_table(monitor.engine, owners),
            replicas_table(monitor.engine),
        )

    def pick(evt: gr.SelectData) -> tuple[str, str]:
        """A click on a row of the sessions table chooses that session for the buttons."""
        row = evt.row_value or []
        if len(row) < 3:
            return gr.update(), gr.update()
        return str(row[0]), f"Selected **{row[0]}** ({row[1]}): {row[2] or 'untitled'}"

    def act(action: str, prefix: str) -> str:
        prefix = (prefix or "").strip()
        if action in ("drain", "undrain"):
            try:
                monitor.engine.drain(prefix, draining=action == "drain")
            except CrowdchatError as e:
                return str(e)
            return f"{action}ed {prefix}: new turns " + (
                "go to the other replicas" if action == "drain" else "may go there again"
            )
        matches = sessions.find_sessions(prefix)
        if len(matches) != 1:
            return f"No single session starts with {prefix!r}."
        sid = matches[0]
        if action == "persist":
            done = sessions.persist_now(sid)
            return f"persisted {sid[:12]}" if done else f"{sid[:12]} has no resident KV"
        if action == "drop":
            sessions.drop_kv(sid)
            return f"dropped the KV of {sid[:12]}"
        sessions.admin_delete(sid)
        return f"deleted {sid[:12]}"

    with gr.Blocks(title="crowdchat admin") as demo:
        gr.Markdown("## crowdchat · admin")
        gr.Markdown(zone_note(), elem_id="zone")
        mem = gr.HTML(elem_id="memory")
        length = gr.Number(
            2000,
            label="Conversation length for the capacity hint (tokens)",
            minimum=1,
            maximum=10**6,
            precision=0,
        )
        summary = gr.Markdown(elem_id="totals")
        with gr.Row(elem_id="plots"):  # four abreast on a desktop, one above another on a phone
            lines = [
                gr.LinePlot(
                    x="seconds ago",
                    y="value",
                    color="metric",
                    title=title,
                    height=220,
                    min_width=240,
                    x_title="seconds ago",
                    y_title="",
                )
                for title in plots
            ]
        table = gr.Dataframe(
            label="Sessions (the most recently active first; up to 200): click a row to act on it",
            interactive=False,
            elem_id="sessions",
        )
        served = gr.Dataframe(
            label="Served tokens per user (top 10, the rest as 'other')",
            interactive=False,
            elem_id="served",
        )
        picked = gr.Markdown("Click a session's row to choose it.", elem_id="picked")
        with gr.Row(elem_id="session-actions"):
            target = gr.Textbox(
                label="Session id (the row clicked, or a unique prefix)",
                scale=3,
                min_width=200,
                elem_id="session-id",
            )
            persist_btn = gr.Button("Persist to disk now", size="sm", elem_id="persist")
            drop_btn = gr.Button("Drop KV", size="sm", elem_id="drop-kv")
            delete_btn = gr.Button("Delete session", size="sm", variant="stop", elem_id="delete")
        upstream = bool(monitor.engine.stats().replicas)
        replicas = gr.Dataframe(
            label="Upstream replicas (vLLM's /metrics per replica)",
            interactive=False,
            elem_id="replicas",
            visible=upstream,
        )
        with gr.Row(visible=upstream):
            replica = gr.Textbox(label="Replica URL", scale=3)
            drain_btn = gr.Button("Drain (move new turns off)", size="sm")
            undrain_btn = gr.Button("Undrain", size="sm")
        result = gr.Markdown(elem_id="result")
        build_shared_prompts(sessions)
        if users is not None:
            build_users_section(users)
        outputs = [mem, summary, *lines, table, served, replicas]
        timer = gr.Timer(REFRESH_S)
        timer.tick(refresh, [length], outputs, show_progress="hidden", concurrency_limit=None)
        demo.load(refresh, [length], outputs, concurrency_limit=None)
        table.select(pick, None, [target, picked], concurrency_limit=None)
        for btn, action in ((persist_btn, "persist"), (drop_btn, "drop"), (delete_btn, "delete")):
            btn.click(lambda p, a=action: act(a, p), [target], [result], concurrency_limit=None)
        for btn, action in ((drain_btn, "drain"), (undrain_btn, "undrain")):
            btn.click(lambda p, a=action: act(a, p), [replica], [result], concurrency_limit=None)
    poll_less(demo)  # its queue's idle polling (ui.queue_polling)
    return demo
