"""OpenAI-compatible endpoints: models, server-side sessions and chat completions (SSE too)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.chat_request import ChatRequest, parse_chat_request, parse_end_user, parse_json_object
from api.errors import ApiError, error_body, error_response
from api.sessions_api import build_sessions_router, owner_of, with_session_settings
from engine import Backend
from sessions import Reply, SessionManager
from sessions.relay import AsyncRelay, Delta, End, Event, Failed
from sessions.reply import kv_source

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.1  # how often a request that has sent nothing yet checks its client
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, logs show why


def _usage(reply: Reply) -> dict:
    prompt, completion = reply.num_prompt_tokens, reply.num_generated_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(reply: Reply) -> str:
    # OpenAI knows stop and length; a reply stopped by its owner (cancelled) ended on purpose
    return "length" if str(reply.finish_reason) == "length" else "stop"


async def _next_or_gone(stream: AsyncRelay, request: Request) -> Event | None:
    """The stream's next event, or None (and the request cancelled) if the client left."""
    while True:
        try:
            return await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                stream.cancel()
                return None


def build_router(
    engine: Backend,
    sessions: SessionManager,
    model_name: str,
    share_links: bool = True,
    end_user_header: str = "",
) -> APIRouter:
    """The /v1 routes over a running engine and session manager. `end_user_header`: the
    header (lower case) that names a request's end user besides the `user` field ('' none)."""
    router = APIRouter()
    router.include_router(build_sessions_router(sessions, share_links, end_user_header))
    started = int(time.time())

    def start(owner: str, sid: str | None, req: ChatRequest, end_user: str | None) -> Reply:
        """Worker thread: submit a one-off conversation, or the new turn of a session."""
        if sid is None:
            return sessions.complete(owner, req.messages, req.params, end_user)
        last = req.messages[-1]
        if last["role"] != "user":
            sessions.get_session(owner, sid)  # an unknown session is a 404 before a 400
            raise ApiError(
                "with X-Session-Id the last message must be the user's new message "
                "(the server keeps the history)",
                param="messages",
            )
        return sessions.chat(owner, sid, last["content"], req.params, end_user)

    @router.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": started,
                        "owned_by": "crowdchat",
                    }
                ],
            }
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = parse_json_object(await request.body())
            owner, sid = owner_of(request), request.headers.get("x-session-id")
            if sid is not None:  # what the request leaves out, the conversation's settings say
                settings = await asyncio.to_thread(sessions.stored_settings, owner, sid)
                body = body if settings is None else with_session_settings(body, settings)
            req = parse_chat_request(
                body, engine.max_model_len, sessions.config.max_messages_per_request
            )
            end_user = parse_end_user(body, request.headers, end_user_header)
            source = await asyncio.to_thread(start, owner, sid, req, end_user)
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body
            return error_response(e)
        stream = AsyncRelay(source)
        try:
            return await _respond(request, req, source, stream, model_name)
        except BaseException:  # the handler itself was cancelled (server shutdown)
            stream.cancel()
            raise

    return router


async def _respond(
    request: Request, req: ChatRequest, source: Reply, stream: AsyncRelay, model_name: str
) -> Response:
    """The whole reply (non-streaming) or an SSE response, once the first event is known."""
    # Wait for the first token before answering, so that errors found on the way
    # (a full queue, a failed restore) still get their own HTTP status.
    first = await _next_or_gone(stream, request)
    if first is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(first, Failed):
        return error_response(first.error)
    meta = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": model_name,
    }
    # where the prompt's KV came from: resident, host, disk, cached (shared blocks) or cold
    where = kv_source(source)
    kv = {} if where is None else {"X-Crowdchat-KV": where}
    if req.stream:
        return StreamingResponse(
            _sse(stream, first, source, meta, req.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kv},
        )
    parts, event = [], first
    while not isinstance(event, End):
        if event is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(event, Failed):
            return error_response(event.error)
        parts.append(event.text)
        event = await _next_or_gone(stream, request)
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": _finish_reason(source),
                    "message": {"role": "assistant", "content": "".join(parts)},
                }
            ],
            "usage": _usage(source),
        },
        headers=kv,
    )


def _data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(
    stream: AsyncRelay, first: Event, source: Reply, meta: dict, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: role chunk, content chunks, finish chunk, usage chunk, [DONE].

    Each content chunk carries every delta that arrived since the last one (under load that
    saves a write and a parse per token for the server and the client alike), built from a
    prepared head and tail around the one `json.dumps` of its text.

    If the client disconnects, Starlette cancels this generator at its `await`, and the
    `finally` cancels the request so its KV blocks are freed at the engine's next step.
    """
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _data(
            {
                **meta,
                "object": "chat.completion.chunk",
                **extra,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
        )

    head, tail = chunk({"content": "\0"}).split(json.dumps("\0"))
    try:
        yield chunk({"role": "assistant", "content": ""})
        event = first
        while isinstance(event, Delta):
            yield head + json.dumps(event.text, ensure_ascii=False) + tail
            event = await stream.next()
        if isinstance(event, Failed):
            yield _data(error_body(event.error)[1])
        else:
            yield chunk({}, _finish_reason(source))
            if include_usage:
                yield _data(
                    {
                        **meta,
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": _usage(source),
                    }
                )
        yield _data("[DONE]")
    finally:
        stream.cancel()
