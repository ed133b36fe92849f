"""From users' text to token ids: message cleaning, the conversation, and its encoding."""

from __future__ import annotations

import functools
import re
import secrets

from engine import InvalidRequest, PromptTooLong, SamplingParams
from engine.chat_format import ChatFormatter
from sessions.token_cache import LongTextTokens

Message = dict[str, str]  # {"role": ..., "content": ...}
KEEP_FRACTION = 0.75  # a conversation that outgrew its context is cut down to this much of it
TOKEN_CACHE_ENTRIES = 16_384  # tokenized pieces of text kept (messages, template pieces)
# longer texts go to a cache bounded by characters (sessions.token_cache), so whatever clients
# send, both stay bounded: 16,384 texts of at most 2,048 characters and their ids (as Python
# ints, ~36 bytes each): ~300 MB at ~4 characters a token, ~1.2 GB if every character were one
CACHED_TEXT_CHARS = 2_048
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # Unicode's Cc but tab and newline


def clean_text(text: object, limit: int) -> str:
    """A user's message as safe text, or InvalidRequest saying what is wrong with it."""
    if not isinstance(text, str):
        raise InvalidRequest("the message must be text")
    # checked first, so a huge message costs no more than its length to refuse
    if len(text) > limit:
        raise InvalidRequest(f"the message is {len(text)} characters; the limit is {limit}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the message is not valid UTF-8 text") from None
    # control characters (category Cc) other than tab and newline carry no meaning in a chat
    # message
    text = CONTROL.sub("", text)
    if not text.strip():
        raise InvalidRequest("the message is empty")
    return text


def clean_system_prompt(text: str, limit: int) -> str:
    """A system prompt as kept: safe text without surrounding whitespace (as shared prompts
    are, so one pasted with a trailing newline still matches its shared twin), "" for none."""
    return clean_text(text, limit).strip() if text.strip() else ""


def clean_messages(messages: list[Message], limit: int) -> list[Message]:
    """A whole conversation sent at once (the API's one-off requests), checked like chat
    messages: the last must say something, none may be over the length limit."""
    out = []
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        if m["content"].strip() or last:
            out.append({"role": m["role"], "content": clean_text(m["content"], limit)})
    return out


def user_says(text: str) -> Message:
    """The user's new message, last in a turn's conversation."""
    return {"role": "user", "content": text}


def conversation(session: dict, history: list[dict], default_system: str = "") -> list[Message]:
    """The session's system prompt (or the server's default) and stored messages as chat
    messages (empty replies, e.g. a turn stopped before its first token, are left out)."""
    system = session["system_prompt"] or default_system
    convo = [{"role": "system", "content": system}] if system else []
    convo += [
        {"role": m["role"], "content": m["content"]}
        for m in history
        if m["role"] == "user" or m["content"]
    ]
    return convo


def first_kept(costs: list[int], is_user: list[bool], fixed: int, budget: int) -> int:
    """The index of the first turn a conversation keeps, given each turn's token cost, the
    tokens always kept (template head, system prompt) and the prompt budget.

    The turns are replayed as they came, each user message being one turn's prompt. Once a
    prompt outgrows the budget, the oldest turns go at once until it fills KEEP_FRACTION of
    the budget, and that cut holds until the conversation outgrows the budget again: every
    turn finds the cut its predecessors used, so their KV prefix stays valid and a turn
    prefills only its new tokens (a cut that moved every turn recomputed the whole context
    each turn). Kept turns start with a user message.
    """
    target = int(budget * KEEP_FRACTION)
    start, total = 0, fixed
    for i, cost in enumerate(costs):
        total += cost
        if (is_user[i] or i == len(costs) - 1) and total > budget:
            while start < i and (total > target or not is_user[start]):
                total -= costs[start]
                start += 1
    return start


class PromptEncoder:
    """The one ChatFormatter of the session layer, and the context it must fit. Each piece
    of text (a message, a piece of the template) is tokenized once and cached.

    `shared_system_prompts` are the operator's: conversations that start with one of them (or
    with the template's own default system prompt) may share its KV with every user.
    """

    def __init__(
        self,
        formatter: ChatFormatter,
        max_model_len: int,
        shared_system_prompts: tuple[str, ...] = (),
    ) -> None:
        self.formatter = formatter
        self.max_model_len = max_model_len
        self._cached = functools.lru_cache(maxsize=TOKEN_CACHE_ENTRIES)(self._tokenize)
        self._long = LongTextTokens(self._tokenize)  # no turn tokenizes a long message again
        self.share(shared_system_prompts)

    def _tokens(self, text: str, user_text: bool) -> tuple[int, ...]:
        if len(text) > CACHED_TEXT_CHARS:
            return self._long(text, user_text)
        return self._cached(text, user_text)

    def share(self, shared_system_prompts: tuple[str, ...]) -> None:
        """From now on, these system prompts (and the template's default) are the shared
        ones (the list is replaced whole, so a turn encoding meanwhile sees old or new)."""
        probe = {"role": "user", "content": "?"}
        heads = [self.pieces([probe])[0]]  # template text only: its default system prompt
        for text in shared_system_prompts:
            p = self.pieces([{"role": "system", "content": text}, probe])
            heads.append(p[0] + p[1] + p[2])  # up to where the first user message starts
        self.shared_heads = sorted(set(heads), key=len, reverse=True)

    def shareable(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` any user may share: the longest operator-shared
        head they start with. Judged by the ids alone (wherever they came from: a prompt, a
        snapshot), and safe so: a user's text is tokenized with special tokens split, so it
        can never produce the template's markup that closes a shared head."""
        for head in self.shared_heads:
            if len(head) <= len(ids) and tuple(ids[: len(head)]) == head:
                return len(head)
        return 0

    def encode(self, messages: list[Message], limit: int) -> list[int]:
        """Token ids of a conversation as it is (a one-off request: nothing is dropped), or
        PromptTooLong once the messages' own tokens pass `limit`: each message is tokenized
        once, in order, and a request far over the context stops there, before the rest is
        tokenized or the prompt is built."""
        contents, total = [], 0
        for m in messages:  # cached: a stateless client sends the whole history every turn
            contents.append(self._tokens(m["content"], True))
            total += len(contents[-1])
            if total > limit:
                raise PromptTooLong(
                    f"the messages are over {total} tokens long; this server's context "
                    f"holds {limit} (send fewer or shorter messages)"
                )
        ids = [t for piece in self.pieces(messages, contents) for t in piece]
        if len(ids) > limit:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens long; this server's context holds {limit} "
                "(send fewer or shorter messages)"
            )
        return ids

    def encode_fitting(self, convo: list[Message], params: SamplingParams) -> list[int]:
        """Token ids of the conversation; the oldest turns give way, in steps (see
        `first_kept`), when it outgrows the context. The system prompt and the newest message
        always stay."""
        budget = self.max_model_len - min(params.max_new_tokens, 256)
        n_system = 1 if convo and convo[0]["role"] == "system" else 0
        pieces = self.pieces(convo)
        # message i is its text and the template after it (its end, the next one's start)
        costs = [len(pieces[2 * i + 1]) + len(pieces[2 * i + 2]) for i in range(len(convo))]
        turns = convo[n_system:]
        start = n_system + first_kept(
            costs[n_system:],
            [m["role"] == "user" for m in turns],
            len(pieces[0]) + sum(costs[:n_system]),
            budget,
        )
        while True:
            kept = convo[:n_system] + convo[start:]
            ids = [
                t for piece in (pieces if start == n_system else self.pieces(kept)) for t in piece
            ]
            if len(ids) <= budget:
                return ids
            # a template whose pieces depend on their neighbours: one more turn goes
            later = [i for i in range(start + 1, len(convo)) if convo[i]["role"] == "user"]
            if not later:
                raise PromptTooLong(
                    f"the message is {len(ids)} tokens long; this server's "
                    f"context holds {budget} (shorten it)"
                )
            start = later[0]

    def pieces(
        self, messages: list[Message], contents: list[tuple[int, ...]] | None = None
    ) -> list[tuple[int, ...]]:
        """The ids `ChatFormatter.encode` gives, in pieces: template text, message 0's text,
        template text, message 1's text, ..., template text (with the generation prompt).
        `contents`: the messages' texts already tokenized."""
        marker = f"\x00{secrets.token_hex(8)}"
        masked = [
            {"role": m["role"], "content": f"{marker}{i}{marker}"} for i, m in enumerate(messages)
        ]
        rendered = self.formatter.tokenizer.apply_chat_template(
            masked, tokenize=False, add_generation_prompt=True
        )
        parts = rendered.split(marker)
        assert len(parts) == 2 * len(messages) + 1, "the template dropped or repeated a message"
        return [
            self._tokens(part, False)
            if i % 2 == 0
            else contents[int(part)]
            if contents is not None
            else self._tokens(messages[int(part)]["content"], True)
            for i, part in enumerate(parts)
        ]

    def _tokenize(self, text: str, user_text: bool) -> tuple[int, ...]:
        # user text never becomes markup: special tokens typed in it are split (as in
        # ChatFormatter); template text keeps them
        extra = {"split_special_tokens": True} if user_text else {}
        return tuple(self.formatter.tokenizer.encode(text, add_special_tokens=False, **extra))
