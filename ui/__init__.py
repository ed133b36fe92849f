"""The Gradio pages: the chat page for everyone, the admin page for the operator."""
