"""Fuzz the OpenAI request parser (api/chat_request.py) on raw request bodies, as
`/v1/chat/completions` and `/v1/sessions` read them.

A body becomes a ChatRequest (messages of known roles and text, sampling parameters the engine
accepts) or an `ApiError` / `InvalidRequest`, which the API answers with a 4xx; anything else
(a RecursionError, a KeyError, an OverflowError...) would be a 500 and is a finding.
"""

from __future__ import annotations

import _harness
import atheris

from engine.errors import InvalidRequest
from engine.sequence import SamplingParams  # before api.chat_request: not instrumented

with atheris.instrument_imports(include=["api.chat_request"]):  # api/__init__ imports it
    from api.chat_request import parse_chat_request, parse_json_object, typed_field
    from api.errors import ApiError, error_body

atheris.instrument_func(SamplingParams.__post_init__)  # the engine's own checks

MAX_MODEL_LEN = 2048
MAX_MESSAGES = 64
ROLES = {"system", "user", "assistant"}


def refused(error: Exception) -> None:
    """A request error must be one the API answers with a 4xx."""
    status, body = error_body(error)
    assert 400 <= status < 500, (status, body)


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    try:  # /v1/sessions: an optional JSON object with an optional title
        typed_field(parse_json_object(data, required=False), "title", "str")
    except (ApiError, InvalidRequest) as e:
        refused(e)
    try:
        req = parse_chat_request(parse_json_object(data), MAX_MODEL_LEN, MAX_MESSAGES)
    except (ApiError, InvalidRequest) as e:
        refused(e)
        return
    assert 0 < len(req.messages) <= MAX_MESSAGES
    for m in req.messages:
        assert set(m) == {"role", "content"} and m["role"] in ROLES, m
        assert isinstance(m["content"], str)
    assert 1 <= req.params.max_new_tokens <= MAX_MODEL_LEN
    assert isinstance(req.stream, bool) and isinstance(req.include_usage, bool)


if __name__ == "__main__":
    _harness.main("chat_request", test_one_input)
