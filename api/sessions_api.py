"""Conversations kept on the server, over HTTP: create, list and search, read, change
(title, system prompt, sampling settings), delete, export and import. Each call is the
caller's own: another user's conversation is a 404, the same as one that does not exist."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.chat_request import parse_end_user, parse_json_object, typed_field
from api.errors import ApiError, error_response
from doors.identity import bearer, identity_of, token_owner
from engine import InvalidRequest
from sessions import SessionManager
from sessions.chat_settings import ChatSettings


def owner_of(request: Request) -> str:
    """The caller: the identity the Doors middleware found (an API key's user, a key of the
    --api-keys file, the open API's client address); these routes mounted without the
    middleware (their own tests) take a hash of the bearer string, 'api:anonymous' without."""
    identity = identity_of(request.scope)
    return identity.owner if identity is not None else token_owner(bearer(request.headers))


def with_session_settings(body: dict, settings: ChatSettings) -> dict:
    """A chat request's body with the conversation's settings where the request names none
    (`max_completion_tokens` counts as naming `max_tokens`)."""
    given = {k for k, v in body.items() if v is not None}
    if "max_completion_tokens" in given:
        given.add("max_tokens")
    return {**{k: v for k, v in settings.as_dict().items() if k not in given}, **body}


def session_object(row: dict) -> dict:
    return {
        "id": row["id"],
        "object": "session",
        "title": row["title"],
        "last_active": int(row["last_active"]),
    }


def _settings_field(body: dict, base: ChatSettings | None = None) -> ChatSettings | None:
    value = body.get("settings")
    if value is None:
        return None
    try:
        return ChatSettings.from_dict(value, base)
    except InvalidRequest as e:
        raise ApiError(f"settings: {e}", param="settings") from None


def _attachment(content: str, name: str, media_type: str) -> Response:
    """A download named `name`: an ASCII `filename` for every client, the name itself in
    `filename*` (RFC 6266) for those that read it (a header is Latin-1: a title in another
    script would not fit)."""
    plain = name.encode("ascii", "ignore").decode() or "conversation"
    disposition = f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(name)}"
    return Response(content, media_type=media_type, headers={"Content-Disposition": disposition})


def json_attachment(name: str, export: dict) -> Response:
    """An export file as a download."""
    return _attachment(json.dumps(export, ensure_ascii=False, indent=1), name, "application/json")


def markdown_attachment(name: str, text: str) -> Response:
    return _attachment(text, name, "text/markdown; charset=utf-8")


def build_sessions_router(
    sessions: SessionManager, share_links: bool = True, end_user_header: str = ""
) -> APIRouter:
    """The /v1/sessions routes over a session manager (`share_links`: --share-links is not
    off; `end_user_header`: --end-user-header)."""
    router = APIRouter()

    async def answer(request: Request, work: Callable[[str], Any]) -> Response:
        """Run `work(owner)` on a worker thread; its value as JSON (a Response as it is),
        any error as an OpenAI-style body."""
        try:
            result = await asyncio.to_thread(work, owner_of(request))
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body
            return error_response(e)
        return result if isinstance(result, Response) else JSONResponse(result)

    @router.post("/v1/sessions")
    async def create_session(request: Request) -> Response:
        try:
            body = parse_json_object(await request.body(), required=False)
            title = typed_field(body, "title", "str") or ""
            system_prompt = typed_field(body, "system_prompt", "str") or ""
            settings = _settings_field(body)
        except Exception as e:  # noqa: BLE001
            return error_response(e)

        def create(owner: str) -> dict:
            row = sessions.create_session(owner, title, system_prompt, settings)
            return {"id": row["id"], "object": "session", "created": int(row["created"])}

        return await answer(request, create)

    @router.get("/v1/sessions")
    async def list_sessions(request: Request, q: str | None = None, limit: str = "20") -> Response:
        """The caller's conversations, most recent first; with `q`, those whose title or
        messages match it, best first, each with the matching snippet."""

        def listed(owner: str) -> dict:
            if q is None:
                data = [session_object(r) for r in sessions.list_sessions(owner)]
            else:
                if not limit.isdigit():
                    raise InvalidRequest("limit must be a whole number")
                data = [
                    {**session_object({**h, "id": h["session_id"]}), "match": _match(h)}
                    for h in sessions.search(owner, q, int(limit))
                ]
            return {"object": "list", "data": data}

        return await answer(request, listed)

    @router.get("/v1/usage")
    async def usage(request: Request) -> Response:
        """Where the caller stands against the per-user limits (0: that limit is off), or
        the end user it names (`?user=NAME`, or the header the operator named), as the limits
        count that end user's requests."""
        try:
            query = {"user": request.query_params["user"]} if "user" in request.query_params else {}
            end_user = parse_end_user(query, request.headers, end_user_header)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return await answer(
            request, lambda owner: {"object": "usage", **sessions.usage(owner, end_user)}
        )

    @router.get("/v1/sessions/export")
    async def export_all(request: Request) -> Response:
        """Every conversation of the caller's, every branch, as one JSON file."""
        return await answer(
            request, lambda owner: json_attachment(*sessions.export_json_file(owner))
        )

    @router.post("/v1/sessions/import")
    async def import_file(request: Request) -> Response:
        """A crowdchat export or ChatGPT's conversations.json as the body: new conversations
        of the caller's, all of them or none."""
        try:
            data = await request.body()
        except Exception as e:  # noqa: BLE001 - the body cap's 413
            return error_response(e)

        def imported(owner: str) -> dict:
            ids, skipped = sessions.import_file(owner, data)
            rows = [sessions.get_session(owner, sid) for sid in ids]
            return {"object": "list", "data": [session_object(r) for r in rows], "skipped": skipped}

        return await answer(request, imported)

    @router.get("/v1/sessions/{sid}")
    async def get_session(request: Request, sid: str) -> Response:
        """The conversation: title, system prompt, settings (null: each request says) and its
        active branch."""

        def read(owner: str) -> dict:
            row = sessions.get_session(owner, sid)
            settings = ChatSettings.from_json(row.get("settings"))
            return {
                **session_object(row),
                "created": int(row["created"]),
                "system_prompt": row["system_prompt"],
                "settings": None if settings is None else settings.as_dict(),
                "messages": [
                    {"role": m["role"], "content": m["content"], "branches": m["branches"]}
                    for m in sessions.store.messages(sid)  # the owner's: checked above
                ],
            }

        return await answer(request, read)

    @router.patch("/v1/sessions/{sid}")
    async def change_session(request: Request, sid: str) -> Response:
        """Change the title, the system prompt or (some of) the settings."""
        try:
            body = parse_json_object(await request.body())
            title = typed_field(body, "title", "str")
            system_prompt = typed_field(body, "system_prompt", "str")
        except Exception as e:  # noqa: BLE001
            return error_response(e)

        def change(owner: str) -> dict:
            settings = _settings_field(body, sessions.settings(owner, sid))
            if title is not None:
                sessions.rename_session(owner, sid, title)
            if system_prompt is not None:
                sessions.set_system_prompt(owner, sid, system_prompt)
            if settings is not None:
                sessions.set_settings(owner, sid, settings)
            return session_object(sessions.get_session(owner, sid))

        return await answer(request, change)

    @router.delete("/v1/sessions/{sid}")
    async def delete_session(request: Request, sid: str) -> Response:
        def delete(owner: str) -> dict:
            sessions.delete_session(owner, sid)
            return {"id": sid, "object": "session", "deleted": True}

        return await answer(request, delete)

    @router.get("/v1/sessions/{sid}/export")
    async def export_session(request: Request, sid: str, format: str = "json") -> Response:
        """One conversation: `format=json` (every branch) or `markdown` (the active one)."""

        def export(owner: str) -> Response:
            if format == "markdown":
                return markdown_attachment(*sessions.export_markdown(owner, sid))
            if format != "json":
                raise InvalidRequest("format must be json or markdown")
            return json_attachment(*sessions.export_json_file(owner, sid))

        return await answer(request, export)

    @router.post("/v1/sessions/{sid}/shares")
    async def share(request: Request, sid: str) -> Response:
        """A read-only link to the conversation's active branch as it is now."""

        def create(owner: str) -> dict:
            if not share_links:
                raise InvalidRequest("share links are off on this server (--share-links)")
            return _share_object(sessions.share(owner, sid))

        return await answer(request, create)

    @router.get("/v1/sessions/{sid}/shares")
    async def list_shares(request: Request, sid: str) -> Response:
        def listed(owner: str) -> dict:
            return {
                "object": "list",
                "data": [_share_object(s) for s in sessions.shares(owner, sid)],
            }

        return await answer(request, listed)

    @router.delete("/v1/shares/{token}")
    async def revoke_share(request: Request, token: str) -> Response:
        def revoke(owner: str) -> dict:
            sessions.revoke_share(owner, token)
            return {"id": token, "object": "share", "deleted": True}

        return await answer(request, revoke)

    return router


def _share_object(row: dict) -> dict:
    return {
        "id": row["token"],
        "object": "share",
        "session_id": row["session_id"],
        "created": int(row["created"]),
        "path": f"/share/{row['token']}",
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
