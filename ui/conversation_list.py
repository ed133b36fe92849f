"""The sidebar's conversation list: a search box (as you type), the conversations grouped by
day in the browser's calendar (Today, Yesterday, Previous 7 days, Older), one line each, the
open one marked, each with its own menu (rename in place, share, export, delete after a
confirmation), and more conversations loaded as the user scrolls to the end.

One `gr.HTML` whose value is the list (`ChatPage.listing`) and whose script,
static/conversation_list.js, draws it with text nodes only (a title is never parsed as HTML)
and sends what the user does as the component's own events ('pick', 'rename', 'remove',
'share_link', 'more', 'find'), each carrying the conversation's id."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import PAGE, ChatPage, Screen

SCRIPT = Path(__file__).resolve().parent.parent / "static" / "conversation_list.js"
SKELETON = (
    '<input type="search" class="cc-find" placeholder="Search" aria-label="Search your '
    'conversations"><nav class="cc-list" aria-label="Your conversations"></nav>'
)
MARKS = ("\u0001", "\u0002")  # the matching words of a hit (drawn bold by the script)


def _data(evt: gr.EventData) -> dict:
    data = getattr(evt, "_data", None)
    return data if isinstance(data, dict) else {}


def _id(evt: gr.EventData) -> str | None:
    sid = _data(evt).get("id")
    return sid if isinstance(sid, str) and sid else None


def hits_of(found: list[dict]) -> list[dict]:
    """Search hits one per conversation (its best, the first), in the store's order."""
    seen: dict[str, dict] = {}
    for h in found:
        if h["session_id"] in seen:
            continue
        where = "title" if h["message_id"] is None else ("you" if h["role"] == "user" else "reply")
        seen[h["session_id"]] = {
            "id": h["session_id"],
            "title": h["title"],
            "where": where,
            "snippet": " ".join(h["snippet"].split()),
            "message": h["message_id"],
        }
    return list(seen.values())


class ConversationList:
    """Handlers of the list's events (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_pick(self, evt: gr.EventData, screen: Screen, request: gr.Request) -> tuple:
        """A click on a conversation, or on a search hit (which also puts the matching
        message on the path shown). Outputs as ChatPage.show."""
        sid, message = _id(evt), _data(evt).get("message")
        if sid and isinstance(message, int):
            try:
                self.sm.show_message(self.page.owner(request), sid, message)
            except CrowdchatError as e:
                return (*(gr.skip(),) * 2, f"Error: {e}", *(gr.skip(),) * 5)
        return self.page.on_select(sid, screen, request)

    def on_rename(self, evt: gr.EventData, screen: Screen, request: gr.Request) -> tuple:
        title = _data(evt).get("title")
        sid = _id(evt)
        if not sid or not isinstance(title, str):
            return gr.skip(), ""
        return self.page.on_rename(sid, title, screen, request)

    def on_remove(self, evt: gr.EventData, screen: Screen, request: gr.Request) -> tuple:
        sid = _id(evt)
        if not sid:
            return (gr.skip(),) * 8
        return self.page.on_delete(sid, screen, request)

    def on_more(self, screen: Screen, request: gr.Request) -> dict:
        """The user scrolled to the end of the list: the next page of conversations."""
        owner = self.page.owner(request)
        screen.shown += PAGE
        return self.page.listing(owner, screen.sid, screen)

    def on_find(self, evt: gr.EventData, screen: Screen, request: gr.Request) -> tuple:
        """The search box (debounced in the browser). Outputs: the list (its hits for the
        query it answers), the status line."""
        owner = self.page.owner(request)
        text = _data(evt).get("text")
        text = text if isinstance(text, str) else ""
        listing = self.page.listing(owner, screen.sid, screen)
        if not text.strip():
            return {**listing, "query": "", "hits": None}, ""
        try:
            found = hits_of(self.sm.search(owner, text, marks=MARKS))
        except CrowdchatError as e:
            return {**listing, "query": text, "hits": []}, f"Error: {e}"
        return {**listing, "query": text, "hits": found}, ""


def build_conversation_list() -> gr.HTML:
    """The list's component (its events are wired by `wire_conversation_list`)."""
    return gr.HTML(
        {"items": [], "open": None, "more": False},
        html_template=SKELETON,
        js_on_load=SCRIPT.read_text(encoding="utf-8"),
        elem_id="convos",
        apply_default_css=False,
    )


def wire_conversation_list(
    convos: gr.HTML,
    handlers: ConversationList,
    screen: gr.State,
    shown: list,
    status: gr.Markdown,
    then_refresh: Callable[[object], None],
) -> None:
    """The list's events. `shown`: ChatPage.show's outputs; `then_refresh`: chains what
    follows a change of conversation (message actions, settings...)."""
    quiet = {"concurrency_limit": None, "show_progress": "hidden"}
    latest = {**quiet, "trigger_mode": "always_last"}
    then_refresh(convos.pick(handlers.on_pick, [screen], shown, **latest))  # type: ignore[attr-defined]
    convos.rename(handlers.on_rename, [screen], [convos, status], **quiet)  # type: ignore[attr-defined]
    then_refresh(convos.remove(handlers.on_remove, [screen], shown, **quiet))  # type: ignore[attr-defined]
    convos.more(handlers.on_more, [screen], [convos], trigger_mode="once", **quiet)  # type: ignore[attr-defined]
    convos.find(handlers.on_find, [screen], [convos, status], **latest)  # type: ignore[attr-defined]
