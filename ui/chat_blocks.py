"""The chat page's layout and event wiring (handlers live in ui.chat_page)."""

from __future__ import annotations

import gradio as gr

from ui.branch_bar import BranchBar
from ui.chat_page import ChatPage, Screen
from ui.keys_page import KeysSection, build_keys_section
from ui.search_section import SearchSection
from ui.settings_section import SettingsSection
from ui.share_section import ShareSection
from ui.transfer_section import TransferSection, export_links
from ui.usage_line import UsageLine


def build_chat_blocks(
    page: ChatPage, concurrency: int, keys: KeysSection | None = None, share_links: bool = True
) -> gr.Blocks:
    """The chat page. `concurrency`: how many users may generate at once (the engine's
    batch size), instead of Gradio's default of one event at a time. `keys`: the API keys
    section for signed-in users. `share_links`: the share box (--share-links not off)."""
    with gr.Blocks(title="crowdchat") as demo:
        sid = gr.State(None)
        editing = gr.State(False)
        screen = gr.State(Screen())  # a copy per tab: which conversation it shows
        with gr.Row(equal_height=False, elem_id="layout"):
            with gr.Column(scale=1, min_width=220, elem_id="sidebar"):
                gr.Markdown("## crowdchat", elem_id="brand")
                new_btn = gr.Button("+ New chat", variant="primary", elem_id="new-chat")
                find = gr.Textbox(
                    placeholder="Search your conversations",
                    show_label=False,
                    max_lines=1,
                    elem_id="search",
                )
                hits = gr.Radio(choices=[], label="Found", visible=False, elem_id="search-hits")
                convos = gr.Radio(choices=[], label="Your conversations", elem_id="convos")
                with gr.Accordion("Rename or delete", open=False):
                    title = gr.Textbox(label="New title", max_lines=1)
                    with gr.Row():
                        rename_btn = gr.Button("Rename", size="sm")
                        delete_btn = gr.Button("Delete", size="sm", variant="stop")
                with gr.Accordion(
                    "Share a read-only link", open=False, elem_id="share", visible=share_links
                ):
                    share_btn = gr.Button("Create a link", size="sm", elem_id="share-create")
                    share_link = gr.Textbox(
                        label="Link (a copy of the conversation as it is now)",
                        interactive=False,
                        buttons=["copy"],
                        elem_id="share-link",
                    )
                    share_list = gr.Dropdown(
                        choices=[],
                        label="Live links",
                        elem_id="share-list",
                        allow_custom_value=False,
                    )
                    revoke_btn = gr.Button("Revoke", size="sm", elem_id="share-revoke")
                with gr.Accordion("Export or import", open=False, elem_id="transfer"):
                    links = gr.HTML(export_links(None), elem_id="export")
                    upload = gr.UploadButton(
                        "Import a file (.json)",
                        file_types=[".json"],
                        type="filepath",
                        size="sm",
                        elem_id="import",
                    )
            with gr.Column(scale=4, min_width=320):
                chatbot = gr.Chatbot(
                    label="Chat",
                    elem_id="chatbot",
                    height="62vh",
                    buttons=["copy"],
                    placeholder="Say hello to start a conversation.",
                )
                with gr.Row(visible=False, elem_id="branches") as branch_row:
                    prev_btn = gr.Button("‹", size="sm", min_width=40, elem_id="branch-prev")
                    branch_label = gr.Markdown("", elem_id="branch-label")
                    next_btn = gr.Button("›", size="sm", min_width=40, elem_id="branch-next")
                status = gr.Markdown("", elem_id="status")
                usage = gr.Markdown("", elem_id="usage")
                with gr.Row(elem_id="composer"):
                    box = gr.Textbox(
                        placeholder="Type a message…",
                        show_label=False,
                        scale=8,
                        lines=1,
                        max_lines=8,
                        elem_id="message",
                        autofocus=True,
                    )
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                    stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
                with gr.Row():
                    regen_btn = gr.Button("↻ Regenerate", size="sm", elem_id="regenerate")
                    edit_btn = gr.Button("✎ Edit last message", size="sm", elem_id="edit")
                with gr.Accordion("Settings", open=False, elem_id="settings"):
                    system = gr.Textbox(
                        label="System prompt",
                        lines=2,
                        elem_id="system",
                        info="Kept with this conversation.",
                        placeholder="e.g. You are a concise assistant.",
                    )
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature")
                    top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p")
                    max_tokens = gr.Slider(
                        16, 2048, value=512, step=16, label="Max new tokens", elem_id="max-tokens"
                    )
                    repetition = gr.Slider(
                        1,
                        2,
                        value=1,
                        step=0.05,
                        label="Repetition penalty",
                        info="Above 1 curbs replies that loop (1: off).",
                        elem_id="repetition",
                    )
                if keys is not None:
                    build_keys_section(keys, demo)

        turn_outputs = [chatbot, status, box, sid, convos, editing]
        bar = BranchBar(page)
        bar_outputs = [branch_row, branch_label]

        sampling = [temperature, top_p, max_tokens, repetition]
        settings = SettingsSection(page)
        transfer = TransferSection(page)
        sharing = ShareSection(page)
        usage_line = UsageLine(page)

        def then_bar(event: object) -> None:
            """After the event (a whole streamed turn included), the switcher shows the
            branches of what is now on screen, the sliders its settings, the export and share
            boxes it, and the usage line where the user stands."""
            # "always_last": a second trigger while one is pending (opening two conversations
            # quickly) runs after it, on the newest state, instead of being dropped ("once")
            quiet = {
                "concurrency_limit": None,
                "show_progress": "hidden",
                "trigger_mode": "always_last",
            }
            event.then(  # type: ignore[attr-defined]
                bar.render,
                [sid, screen],
                bar_outputs,
                concurrency_limit=None,
                trigger_mode="always_last",
            )
            event.then(settings.on_show, [sid, screen], sampling, **quiet)  # type: ignore[attr-defined]
            event.then(transfer.on_links, [sid], [links], **quiet)  # type: ignore[attr-defined]
            if share_links:
                event.then(sharing.on_list, [sid], [share_list], **quiet)  # type: ignore[attr-defined]
            event.then(usage_line.on_usage, None, [usage], **quiet)  # type: ignore[attr-defined]

        send_inputs = [box, sid, editing, system, *sampling, screen]
        # "multiple": a reply still running in a conversation the user left must not block
        # Send in the one they opened (a second Send in a busy one is refused by the session)
        for trigger in (box.submit, send_btn.click):
            sent = trigger(
                page.on_send,
                send_inputs,
                turn_outputs,
                concurrency_limit=concurrency,
                concurrency_id="turns",
                show_progress="hidden",
                trigger_mode="multiple",
            )
            then_bar(sent)
        regenerated = regen_btn.click(
            page.on_regenerate,
            [sid, *sampling, screen],
            turn_outputs,
            concurrency_limit=concurrency,
            concurrency_id="turns",
            show_progress="hidden",
            trigger_mode="multiple",
        )
        then_bar(regenerated)
        for btn, handler in ((prev_btn, bar.on_prev), (next_btn, bar.on_next)):
            btn.click(
                handler,
                [sid, screen],
                [chatbot, status, *bar_outputs],
                concurrency_limit=None,
                show_progress="hidden",
            )
        chatbot.select(bar.on_pick, [sid, screen], bar_outputs, concurrency_limit=None)
        for slider in sampling:  # released, not every step of a drag: each change is a write
            slider.release(
                settings.on_change,
                [sid, *sampling],
                [status],
                concurrency_limit=None,
                show_progress="hidden",
            )
        stop_btn.click(page.on_stop, [sid], None, concurrency_limit=None, show_progress="hidden")
        edit_btn.click(page.on_edit, [sid], [box, editing, status], concurrency_limit=None)
        then_bar(
            new_btn.click(
                page.on_new,
                [screen],
                [sid, chatbot, status, convos, system],
                concurrency_limit=None,
            )
        )
        selected = convos.input(
            page.on_select,
            [convos, screen],
            [sid, chatbot, status, system, convos],
            concurrency_limit=None,
        )
        then_bar(selected)
        search = SearchSection(page)
        find.submit(search.on_search, [find], [hits, status], concurrency_limit=None)
        then_bar(
            hits.input(
                search.on_open,
                [hits, screen],
                [sid, chatbot, status, system, convos],
                concurrency_limit=None,
            )
        )
        upload.upload(transfer.on_import, [upload], [convos, status], concurrency_limit=None)
        share_outputs = [share_link, share_list, status]
        share_btn.click(sharing.on_create, [sid], share_outputs, concurrency_limit=None)
        revoke_btn.click(
            sharing.on_revoke, [sid, share_list], share_outputs, concurrency_limit=None
        )
        rename_btn.click(page.on_rename, [sid, title], [convos, title], concurrency_limit=None)
        deleted = delete_btn.click(
            page.on_delete,
            [sid, screen],
            [sid, chatbot, convos, system],
            concurrency_limit=None,
        )
        loaded = demo.load(
            page.on_load, [screen], [convos, sid, chatbot, system], concurrency_limit=None
        )
        for event in (deleted, loaded):
            then_bar(event)
        # a mark the browser tests wait for: a Send before the load ran could be painted over
        loaded.then(None, js="() => { document.body.dataset.crowdchatLoaded = '1'; }")
    return demo
