"""Parse an OpenAI chat-completions body into messages and SamplingParams, field by field."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from api.errors import ApiError
from engine import InvalidRequest, SamplingParams
from engine.sequence import PENALTIES

DEFAULT_MAX_TOKENS = 256
MAX_END_USER_CHARS = 256  # OpenAI's own examples are hashes of 64 hex digits
# An OpenAI chat body nests 5 deep (messages, a message, content parts, a part); 64 leaves
# room for any client's extras, and refusing past it keeps a `[[[[...` body from recursing
# through the parser (Python's own limit, ~1000, surfaced as a 500).
MAX_JSON_DEPTH = 64
# A JSON string (escapes included, so a `\"` does not end it) or one bracket.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
GREEDY_BELOW = 1e-5  # smaller temperatures overflow the logits; treat them as greedy
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# The engine names its fields differently; its messages should use the names the client sent.
ENGINE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat request: the conversation, how to sample, and how to answer."""

    messages: list[dict[str, str]]
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_json_object(raw: bytes, required: bool = True) -> dict:
    """The body as a JSON object; an empty body is `{}` unless `required`."""
    if not raw.strip() and not required:
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError("the request body is not valid UTF-8 text") from None
    if nests_deeper_than(text, MAX_JSON_DEPTH):
        raise ApiError(
            f"the request body is JSON nested deeper than {MAX_JSON_DEPTH} levels; "
            "this server reads no deeper (an OpenAI chat request needs about 5)"
        )
    try:
        body = json.loads(text)
    except ValueError:
        raise ApiError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def nests_deeper_than(text: str, limit: int) -> bool:
    """Whether the brackets of JSON `text`, outside its strings, nest deeper than `limit`. A
    scan, not a parse: it stops at the first bracket past the limit, and a body with too few
    brackets to nest that deep (every chat request of a few messages) is not scanned."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def typed_field(body: dict, name: str, kind: str) -> object:
    """body[name] if present and not null, checked against `kind` (number/integer/bool/str)."""
    v = body.get(name)
    if v is None:
        return None
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "number":  # huge ints would overflow the engine's float checks
        ok = (isinstance(v, float) and math.isfinite(v)) or (is_int and abs(v) < 1e300)
    else:
        ok = {"integer": is_int, "bool": isinstance(v, bool), "str": isinstance(v, str)}[kind]
    if not ok:
        article = "an" if kind == "integer" else "a"
        what = "boolean" if kind == "bool" else "string" if kind == "str" else kind
        raise ApiError(f"{name} must be {article} {what}, got {v!r}"[:200], param=name)
    return v


def _content(m: dict, i: int) -> str:
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    'only text content parts ({"type": "text", "text": ...}) are supported',
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise ApiError(
        "message content must be a string or a list of text parts", param=f"messages[{i}].content"
    )


def parse_messages(body: dict, max_messages: int | None = None) -> list[dict[str, str]]:
    """`messages` as [{role, content}] with roles system/user/assistant and text content;
    more than `max_messages` are refused before any is looked at."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    if max_messages is not None and len(messages) > max_messages:
        raise ApiError(
            f"the request has {len(messages)} messages; this server accepts at most "
            f"{max_messages} per request",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError("each message must be an object", param=f"messages[{i}]")
        role = ROLE_ALIASES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise ApiError(
                f"message role must be system, user or assistant, got {m.get('role')!r}"[:200],
                param=f"messages[{i}].role",
            )
        out.append({"role": role, "content": _content(m, i)})
    return out


def refuse_unsupported(body: dict) -> None:
    """A clear 400 for the OpenAI features this server does not have, instead of a reply that
    silently ignored them (prose where the client asked for JSON or a tool call). Their
    no-op values (empty lists, `"text"`, `"none"`) pass: some clients always send them."""
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            what = "logit_bias" if name == "logit_bias" else "tools (function calling)"
            raise ApiError(f"{what} are not supported by this server", param=name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise ApiError("tools (function calling) are not supported", param=name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(
            f"response_format {kind!r} is not supported (only plain text)"[:200],
            param="response_format",
        )
    if body.get("top_logprobs") is not None:
        raise ApiError("logprobs are not supported", param="top_logprobs")


def parse_params(body: dict, max_model_len: int) -> SamplingParams:
    """SamplingParams from the OpenAI fields (penalties included) plus vLLM's ignore_eos /
    min_tokens / top_k / repetition_penalty."""
    n = typed_field(body, "n", "integer")
    if n not in (None, 1):
        raise ApiError("only n=1 is supported", param="n")
    if typed_field(body, "logprobs", "bool"):
        raise ApiError("logprobs are not supported", param="logprobs")
    refuse_unsupported(body)
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = typed_field(body, name, "integer")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif max_tokens < 1:
        raise ApiError(f"{name} must be at least 1, got {max_tokens}", param=name)
    temperature = typed_field(body, "temperature", "number")
    temperature = 1.0 if temperature is None else temperature
    if 0 < temperature < GREEDY_BELOW:
        temperature = 0.0
    top_k = typed_field(body, "top_k", "integer") or 0
    seed = typed_field(body, "seed", "integer")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError("seed must fit in 64 bits", param="seed")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    elif not isinstance(stop, str):
        raise ApiError("stop must be a string or a list of strings", param="stop")
    top_p = typed_field(body, "top_p", "number")
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "no top-k" as -1
            max_new_tokens=min(max_tokens, max_model_len),
            min_new_tokens=typed_field(body, "min_tokens", "integer") or 0,
            stop=stop,
            seed=seed,
            ignore_eos=bool(typed_field(body, "ignore_eos", "bool")),
            **{
                name: v
                for name in PENALTIES
                if (v := typed_field(body, name, "number")) is not None
            },
        )
    except InvalidRequest as e:
        message = str(e)
        for engine_name, api_name in ENGINE_NAMES.items():
            message = message.replace(engine_name, api_name)
        first = message.split(" ", 1)[0]
        raise ApiError(message, param=first if first in body else None) from None


def parse_end_user(body: dict, headers: Mapping[str, str], header: str = "") -> str | None:
    """The end user a client serves this request for: the value of the header the operator
    named (--end-user-header), else OpenAI's `user` field; None when neither is sent. A name
    must be printable text of 1 to MAX_END_USER_CHARS characters (ApiError otherwise), as it
    keys the per-user limits."""
    if header and (value := headers.get(header)) is not None:
        return _end_user_name(value, header)
    value = body.get("user")
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(
            f"user must be a string naming your end user, got {type(value).__name__}",
            param="user",
        )
    return _end_user_name(value, "user")


def _end_user_name(value: str, param: str) -> str:
    value = value.strip()
    if not value:
        raise ApiError(f"{param} must not be empty (leave it out instead)", param=param)
    if len(value) > MAX_END_USER_CHARS:
        raise ApiError(
            f"{param} must have at most {MAX_END_USER_CHARS} characters, got {len(value)}",
            param=param,
        )
    if not value.isprintable():
        raise ApiError(f"{param} must not contain control characters", param=param)
    return value


def parse_chat_request(
    body: dict, max_model_len: int, max_messages: int | None = None
) -> ChatRequest:
    """A ChatRequest from a decoded JSON body, or ApiError naming the offending field."""
    stream = bool(typed_field(body, "stream", "bool"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    include_usage = bool(typed_field(options or {}, "include_usage", "bool"))
    return ChatRequest(
        parse_messages(body, max_messages), parse_params(body, max_model_len), stream, include_usage
    )
