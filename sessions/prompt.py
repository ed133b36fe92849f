"""From users' text to token ids: message cleaning, the conversation, and its encoding."""

from __future__ import annotations

import unicodedata

from engine import InvalidRequest, PromptTooLong, SamplingParams
from engine.chat_format import ChatFormatter

Message = dict[str, str]  # {"role": ..., "content": ...}


def clean_text(text: object, limit: int) -> str:
    """A user's message as safe text, or InvalidRequest saying what is wrong with it."""
    if not isinstance(text, str):
        raise InvalidRequest("the message must be text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the message is not valid UTF-8 text") from None
    # control characters other than tab and newline carry no meaning in a chat message
    text = "".join(c for c in text if c in "\t\n" or unicodedata.category(c) != "Cc")
    if not text.strip():
        raise InvalidRequest("the message is empty")
    if len(text) > limit:
        raise InvalidRequest(f"the message is {len(text)} characters; the limit is {limit}")
    return text


def clean_messages(messages: list[Message], limit: int) -> list[Message]:
    """A whole conversation sent at once (the API's one-off requests), checked like chat
    messages: the last must say something, none may be over the length limit."""
    out = []
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        if m["content"].strip() or last:
            out.append({"role": m["role"], "content": clean_text(m["content"], limit)})
    return out


def conversation(session: dict, history: list[dict]) -> list[Message]:
    """The session's system prompt and stored messages as chat messages (empty replies,
    e.g. a turn stopped before its first token, are left out)."""
    convo = [{"role": "system", "content": session["system_prompt"]}] \
        if session["system_prompt"] else []
    convo += [{"role": m["role"], "content": m["content"]} for m in history
              if m["role"] == "user" or m["content"]]
    return convo


class PromptEncoder:
    """The one ChatFormatter of the session layer, and the context it must fit."""

    def __init__(self, formatter: ChatFormatter, max_model_len: int) -> None:
        self.formatter = formatter
        self.max_model_len = max_model_len

    def encode(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation as it is (a one-off request: nothing is dropped)."""
        return self.formatter.encode(messages)

    def encode_fitting(self, convo: list[Message], params: SamplingParams) -> list[int]:
        """Token ids of the conversation; the oldest turns give way when it outgrows the
        context (the system prompt and the newest message always stay)."""
        budget = self.max_model_len - min(params.max_new_tokens, 256)
        system = convo[:1] if convo and convo[0]["role"] == "system" else []
        turns = convo[len(system):]
        while True:
            ids = self.formatter.encode(system + turns)
            if len(ids) <= budget:
                return ids
            if len(turns) <= 1:
                raise PromptTooLong(f"the message is {len(ids)} tokens long; this server's "
                                    f"context holds {budget} (shorten it)")
            turns = turns[2:] if len(turns) > 2 else turns[1:]
