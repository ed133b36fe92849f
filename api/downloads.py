"""The chat page's downloads: its export links point here. These routes sit on the page's door,
so the caller is the page's user (the signed cookie or the sign-in), never a value the client
names; another user's conversation is a 404, the same as none."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from api.sessions_api import json_attachment, markdown_attachment
from doors.identity import identity_of
from sessions import SessionManager, SessionNotFound

EXPORT_ALL = "all"  # /export/all.json: every conversation of the user's


def build_download_router(sessions: SessionManager) -> APIRouter:
    """GET /export/{sid}.md, /export/{sid}.json and /export/all.json for the page's user."""
    router = APIRouter()

    @router.get("/export/{name}")
    async def download(request: Request, name: str) -> Response:
        identity = identity_of(request.scope)
        if identity is None:
            return PlainTextResponse("Sign in on the chat page first.", 401)
        stem, _, suffix = name.rpartition(".")
        try:
            if suffix == "json":  # one conversation, or every one of the user's
                sid = None if stem == EXPORT_ALL else stem
                found = await run_in_threadpool(sessions.export_json_file, identity.owner, sid)
                return json_attachment(*found)
            if suffix == "md":
                found = await run_in_threadpool(sessions.export_markdown, identity.owner, stem)
                return markdown_attachment(*found)
        except SessionNotFound:
            pass
        return PlainTextResponse("No such conversation of yours.", 404)

    return router
