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

from api.chat_request import ChatRequest, parse_chat_request, parse_json_object, typed_field
from api.errors import ApiError, error_body, error_response
from doors.identity import bearer, identity_of, token_owner
from engine import Backend, InvalidRequest
from sessions import Reply, SessionManager
from sessions.relay import AsyncRelay, Delta, End, Event, Failed
from sessions.reply import kv_source

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.1  # how often a request that has sent nothing yet checks its client
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, logs show why


def owner_of(request: Request) -> str:
    """The caller: the identity the Doors middleware found (an API key's user, a key of the
    --api-keys file, the open API's client address); these routes mounted without the
    middleware (their own tests) take a hash of the bearer string, 'api:anonymous' without."""
    identity = identity_of(request.scope)
    return identity.owner if identity is not None else token_owner(bearer(request.headers))


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


def build_router(engine: Backend, sessions: SessionManager, model_name: str) -> APIRouter:
    """The /v1 routes over a running engine and session manager."""
    router = APIRouter()
    started = int(time.time())

    def start(owner: str, sid: str | None, req: ChatRequest) -> Reply:
        """Worker thread: submit a one-off conversation, or the new turn of a session."""
        if sid is None:
            return sessions.complete(owner, req.messages, req.params)
        last = req.messages[-1]
        if last["role"] != "user":
            sessions.get_session(owner, sid)  # an unknown session is a 404 before a 400
            raise ApiError(
                "with X-Session-Id the last message must be the user's new message "
                "(the server keeps the history)",
                param="messages",
            )
        return sessions.chat(owner, sid, last["content"], req.params)

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

    @router.post("/v1/sessions")
    async def create_session(request: Request) -> Response:
        try:
            body = parse_json_object(await request.body(), required=False)
            title = typed_field(body, "title", "str") or ""
            system_prompt = typed_field(body, "system_prompt", "str") or ""
            row = await asyncio.to_thread(
                sessions.create_session, owner_of(request), title, system_prompt
            )
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body
            return error_response(e)
        return JSONResponse(
            {"id": row["id"], "object": "session", "created": int(row.get("created", time.time()))}
        )

    @router.get("/v1/sessions")
    async def list_sessions(request: Request, q: str | None = None, limit: str = "20") -> Response:
        """The caller's conversations, most recent first; with `q`, those whose title or
        messages match it, best first, each with the matching snippet."""
        try:
            owner = owner_of(request)
            if q is None:
                rows = await asyncio.to_thread(sessions.list_sessions, owner)
                data = [_session_object(r) for r in rows]
            else:
                if not limit.isdigit():
                    raise InvalidRequest("limit must be a whole number")
                hits = await asyncio.to_thread(sessions.search, owner, q, int(limit))
                data = [
                    {**_session_object({**h, "id": h["session_id"]}), "match": _match(h)}
                    for h in hits
                ]
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body
            return error_response(e)
        return JSONResponse({"object": "list", "data": data})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            req = parse_chat_request(
                parse_json_object(await request.body()),
                engine.max_model_len,
                sessions.config.max_messages_per_request,
            )
            source = await asyncio.to_thread(
                start, owner_of(request), request.headers.get("x-session-id"), req
            )
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body
            return error_response(e)
        stream = AsyncRelay(source)
        try:
            return await _respond(request, req, source, stream, model_name)
        except BaseException:  # the handler itself was cancelled (server shutdown)
            stream.cancel()
            raise

    return router


def _session_object(row: dict) -> dict:
    return {
        "id": row["id"],
        "object": "session",
        "title": row["title"],
        "last_active": int(row["last_active"]),
    }


def _match(hit: dict) -> dict:
    """Where a search hit matched: the title, or a message (its id and role)."""
    where = "title" if hit["message_id"] is None else "message"
    return {
        "in": where,
        "message_id": hit["message_id"],
        "role": hit["role"],
        "snippet": hit["snippet"],
    }


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
