"""The Gradio pages: the chat page for everyone, the admin page for the operator.

`ui.pages.mount_pages` puts them on the server. Nothing is imported here, so that the modules
without Gradio (`ui.auth`: users and credential checks; `ui.monitor`: the figures the admin
page shows) serve an API-only server (--ui off) that never imports Gradio."""
