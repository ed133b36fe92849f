"""The chat page put together: a sidebar (New chat, search, the conversations by day, each
with its menu), the chat with actions on each message, a status line that speaks only while a
reply waits, the composer, and the settings and share dialogs. Each component builds its own
blocks (ui/sidebar.py, ui/conversation_list.py, ui/header.py, ui/message_actions.py,
ui/composer.py, ui/settings_dialog.py, ui/share_dialog.py); the events that join them are
wired here, in one place, as Gradio's ChatInterface does in `_setup_events`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import gradio as gr
from gradio.data_classes import GradioModel, GradioRootModel

from ui.chat_page import ChatPage, Screen
from ui.composer import build_composer
from ui.conversation_list import ConversationList, wire_conversation_list
from ui.header import build_header
from ui.keys_page import KeysSection
from ui.message_actions import MessageActions, build_message_actions
from ui.settings_dialog import SettingsDialog, build_settings_dialog
from ui.share_dialog import ShareDialog, build_share_dialog
from ui.sidebar import build_sidebar
from ui.transfer_section import TransferSection

# inline $…$ and \(…\), display $$…$$ and \[…\], as KaTeX's auto-render takes them (the longer
# delimiter first, so $$ is not read as two $)
LATEX = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "\\[", "right": "\\]", "display": True},
    {"left": "\\(", "right": "\\)", "display": False},
    {"left": "$", "right": "$", "display": False},
]
QUIET = {"concurrency_limit": None, "show_progress": "hidden"}
EMPTY_BOX = "(...args) => { window.crowdchat.emptyBox(); return args; }"


def postprocessed(component: gr.components.Component, value: object) -> object:
    """`value` as Gradio sends it for `component` (its `postprocess`, as Gradio runs it)."""
    if component.stateful:
        return value
    if isinstance(value, dict) and value.get("__type__") == "update":
        if "value" not in value:
            return value
        return {**value, "value": postprocessed(component, value["value"])}
    out = component.postprocess(value)
    return out.model_dump() if isinstance(out, GradioModel | GradioRootModel) else out


def painted(
    fn: Callable[..., Iterator[tuple]], outputs: Sequence[gr.components.Component]
) -> Callable[..., Iterator[tuple]]:
    """A streamed turn's handler whose every paint leaves it postprocessed, for an event set
    with postprocess=False: Gradio postprocesses each output of a paint on a worker thread of
    its own, and at 8 users on the 2-core box those hops (waking a thread, the GIL handed
    back) were the largest part of the server's Python work per paint (py-spy, GIL holders:
    a quarter of it); here one thread does it all, the one that runs the handler."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> Iterator[tuple]:
        inner = fn(*args, **kwargs)
        try:
            for values in inner:
                yield tuple(postprocessed(c, v) for c, v in zip(outputs, values, strict=True))
        finally:
            inner.close()  # Gradio closed us (the tab went away): the turn is cancelled now

    return run


def build_chat_blocks(
    page: ChatPage, concurrency: int, keys: KeysSection | None = None, share_links: bool = True
) -> gr.Blocks:
    """The chat page. `concurrency`: how many users may generate at once (the engine's
    batch size), instead of Gradio's default of one event at a time. `keys`: the API keys
    section for signed-in users. `share_links`: the share dialog (--share-links not off)."""
    with gr.Blocks(title="crowdchat", fill_height=True, fill_width=True) as demo:
        sid = gr.State(None)
        editing = gr.State(None)  # the message whose refused edit is back in the box
        screen = gr.State(Screen())  # a copy per tab: which conversation it shows
        side = build_sidebar()
        with gr.Column(elem_id="main", scale=1):
            header = build_header(page.sm.engine.model_id)
            chatbot = gr.Chatbot(
                show_label=False,
                elem_id="chatbot",
                buttons=["copy"],
                editable="user",
                latex_delimiters=LATEX,
                group_consecutive_messages=False,
                placeholder="## How can I help you today?",
                scale=1,
                height=None,
                min_height=160,
            )
            actions = build_message_actions()
            status = gr.Markdown("", elem_id="status")
            usage_near = gr.Markdown("", elem_id="usage-near")
            composer = build_composer()
        gr.HTML('<div class="cc-backdrop"></div>', apply_default_css=False, elem_id="backdrop")
        settings_parts = build_settings_dialog(keys, demo)
        share = build_share_dialog() if share_links else None

        sampling = settings_parts.sampling
        system = settings_parts.system
        box, send_btn, stop_btn = composer.box, composer.send, composer.stop
        convos = side.convos
        meta = actions
        # what opening a conversation (or a new one) paints: ChatPage.show's outputs
        shown = [sid, chatbot, status, system, convos, send_btn, stop_btn, editing, meta]
        # what a turn paints as it streams: ChatPage._stream's outputs
        turn = [chatbot, status, sid, convos, send_btn, stop_btn, meta]
        settings = SettingsDialog(page)

        def then_refresh(event: object) -> None:
            """After the event (a whole streamed turn included), the sliders show the
            settings of what is now on screen and the usage line where the user stands; a
            turn's text the engine never took goes back into the message box."""
            # "always_last": a second trigger while one is pending (opening two conversations
            # quickly) runs after it, on the newest state, instead of being dropped ("once")
            quiet = {**QUIET, "trigger_mode": "always_last"}
            event.then(settings.on_show, [sid, screen], sampling, **quiet)  # type: ignore[attr-defined]
            event.then(settings.on_usage, None, [settings_parts.usage, usage_near], **quiet)  # type: ignore[attr-defined]
            event.then(page.on_given_back, [screen], [box, editing], **quiet)  # type: ignore[attr-defined]

        # "multiple": a reply still running in a conversation the user left must not block
        # Send in the one they opened (a second Send in a busy one is refused by the session)
        turns = {
            "concurrency_limit": concurrency,
            "concurrency_id": "turns",
            "show_progress": "hidden",
            "trigger_mode": "multiple",
            "postprocess": False,  # the handlers' paints come postprocessed (painted())
        }
        sending = [box, sid, editing, system, *sampling, screen]
        on_send = painted(page.on_send, turn)
        for trigger in (box.submit, send_btn.click):
            # the browser empties the box as it sends (not the turn: an output of a stream is
            # rebuilt by Gradio at every paint that leaves it as it is)
            then_refresh(trigger(on_send, sending, turn, js=EMPTY_BOX, **turns))
        stop_btn.click(page.on_stop, [sid], None, **QUIET)
        handlers = MessageActions(page)
        on_edit, on_regenerate = (
            painted(handlers.on_edit, turn),
            painted(handlers.on_regenerate, turn),
        )
        then_refresh(chatbot.edit(on_edit, [sid, *sampling, screen], turn, **turns))
        then_refresh(actions.regenerate(on_regenerate, [sid, *sampling, screen], turn, **turns))  # type: ignore[attr-defined]
        actions.branch(handlers.on_branch, [sid, screen], [chatbot, status, meta], **QUIET)  # type: ignore[attr-defined]
        # Gradio's own clear (its trash icon, hidden by static/chat.css) deletes for real
        then_refresh(chatbot.clear(page.on_clear, [screen], shown, **QUIET))
        for new in (side.new_chat, header.new_chat):
            then_refresh(new.click(page.on_new, [screen], shown, **QUIET))
        wire_conversation_list(convos, ConversationList(page), screen, shown, status, then_refresh)
        for slider in sampling:  # released, not every step of a drag: each change is a write
            slider.release(settings.on_change, [sid, *sampling], [status], **QUIET)
        transfer = TransferSection(page)
        settings_parts.upload.upload(
            transfer.on_import, [settings_parts.upload, screen], [convos, status], **QUIET
        )
        if share is not None:
            sharing = ShareDialog(page)
            opened = convos.share_link(  # type: ignore[attr-defined]
                sharing.on_share, None, [share.sid, share.title, share.link, share.links, status]
            )
            opened.then(None, js="() => window.crowdchat.openDialog('share')")
            share.revoke.click(
                sharing.on_revoke, [share.sid, share.links], [share.link, share.links, status]
            )
        loaded = demo.load(page.on_load, [screen], shown, **QUIET)
        then_refresh(loaded)
        # a mark the browser tests wait for: a Send before the load ran could be painted over
        loaded.then(None, js="() => { document.body.dataset.crowdchatLoaded = '1'; }")
    for fn in demo.fns.values():
        fn.show_progress = "hidden"  # no Gradio progress text anywhere on the page
    return demo
