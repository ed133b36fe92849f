"""The chat page's status line: what a reply is waiting for, said only while it waits, and
nothing once it streams (the reply itself is then the news). Also the usage line, shown under
the composer only near a limit (the settings dialog shows it always).

The queue position is the engine's as it stands: never negative (between its admission and its
first step the engine can count it one below zero), and "waiting" only when something waits:
requests ahead of this one, or every slot of the batch busy. A request on a server with room
sits in the queue until the engine's next step (70 ms on the small model, longer on a busy
machine), which is not waiting for anyone and not worth a word: Stop in Send's place says
that a reply is coming."""

from __future__ import annotations

from sessions import ChatTurn

NEAR = 0.8  # the usage line shows under the composer past this share of a limit


def turn_status(turn: ChatTurn, engine: object) -> str:
    """The status line for a turn in flight."""
    if turn.status == "restoring":
        return "Restoring your conversation…"
    if turn.status != "queued":
        return ""  # streaming (the reply shows it) or done
    ahead = turn.queue_position()
    if ahead is None:
        return ""
    ahead = max(ahead, 0)
    if not ahead and not _batch_full(engine):
        return ""
    eta = engine.wait_estimate(ahead)  # type: ignore[attr-defined]
    about = f" (about {eta:.0f} s)" if eta is not None and eta >= 1 else ""
    if ahead:
        return f"Waiting: {ahead} ahead of you{about}…"
    return f"Waiting for a free slot{about}…"


def _batch_full(engine: object) -> bool:
    """Whether every slot of the engine's batch is taken."""
    try:
        running = engine.stats().running  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an engine that cannot say: assume it has room
        return False
    return running >= engine.max_num_seqs  # type: ignore[attr-defined]


def usage_text(u: dict) -> str:
    """One line: tokens this minute, replies answering, conversations kept (limits that are
    off are left out)."""
    parts = []
    if u["tokens_per_minute"]:
        held = u["tokens_used"] + u["tokens_reserved"]
        part = f"{held:,} of {u['tokens_per_minute']:,} tokens this minute"
        if held >= u["tokens_per_minute"] and u["tokens_free_in_seconds"]:
            part += f" (some free in {u['tokens_free_in_seconds']:.0f} s)"
        parts.append(part)
    if u["max_turns_per_user"]:
        parts.append(f"{u['turns_answering']} of {u['max_turns_per_user']} replies at once")
    if u.get("max_storage_bytes"):  # the storage quota (sessions.quota)
        parts.append(
            f"{u['storage_bytes'] / 1e6:.1f} of {u['max_storage_bytes'] / 1e6:.0f} MB kept"
        )
    if u["max_sessions_per_user"]:
        parts.append(f"{u['conversations']} of {u['max_sessions_per_user']} conversations")
    return "Your usage: " + " · ".join(parts) if parts else ""


def near_limit(u: dict) -> bool:
    """Whether any per-user limit is past NEAR of its cap (the composer then shows usage)."""
    held = u["tokens_used"] + u["tokens_reserved"]
    pairs = [
        (held, u["tokens_per_minute"]),
        (u["turns_answering"], u["max_turns_per_user"]),
        (u["conversations"], u["max_sessions_per_user"]),
        (u.get("storage_bytes", 0), u.get("max_storage_bytes", 0)),
    ]
    return any(cap and used >= NEAR * cap for used, cap in pairs)
