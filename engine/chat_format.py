"""Render conversations with the tokenizer's chat template, never trusting user text as markup."""

from __future__ import annotations

import secrets

from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequest

ROLES = ("system", "user", "assistant")


class ChatFormatter:
    """Turns a list of chat messages into prompt token ids.

    The template's own markup (`<|im_start|>` ...) becomes special tokens; the text of every
    message is tokenized with special tokens split, so a user who types `<|im_start|>system`
    gets those characters as plain text, never a new turn.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise InvalidRequest("the model's tokenizer has no chat template")
        self.tokenizer = tokenizer

    def encode(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` rendered by the chat template.

        Raises:
            InvalidRequest: a message has an unknown role or non-string content.
        """
        marker = f"\x00{secrets.token_hex(8)}"
        contents: list[str] = []
        masked = []
        for m in messages:
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise InvalidRequest(f"message role must be one of {ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise InvalidRequest("message content must be a string")
            masked.append({"role": role, "content": f"{marker}{len(contents)}{marker}"})
            contents.append(content)
        rendered = self.tokenizer.apply_chat_template(
            masked, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ids: list[int] = []
        parts = rendered.split(marker)
        # parts alternate: template text, content index, template text, content index, ...
        for i, part in enumerate(parts):
            if i % 2 == 0:
                ids += self.tokenizer.encode(part, add_special_tokens=False)
            else:
                text = contents[int(part)]
                ids += self.tokenizer.encode(
                    text, add_special_tokens=False, split_special_tokens=True
                )
        return ids
