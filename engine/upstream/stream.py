"""One turn on one upstream replica: the streamed `/v1/completions` response becomes the
handle's deltas, and every way it can go wrong becomes the error a user can act on."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from engine.errors import CrowdchatError, InvalidRequest, PromptTooLong, ServerBusy
from engine.handle import RequestHandle
from engine.metrics import Metrics
from engine.sequence import FinishReason, SamplingParams
from engine.upstream.routing import Replica, Router

log = logging.getLogger(__name__)
DRAIN_S = 0.5  # how long the end of a body may lag its `[DONE]` event
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ERROR}
MID_REPLY = (
    "the model server stopped in the middle of this reply ({why}); the part shown is kept. "
    "Send your message again: another server answers with the whole conversation"
)


class Outcome(enum.Enum):
    DONE = "done"  # the handle has ended (finished, or failed with its error)
    RETRY = "retry"  # the replica failed before any token: the next one may take the turn


class UpstreamFailed(Exception):
    """The stream carried an error event, or could not be read."""


def upstream_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body (vLLM: `{"error": {...}}` or, older,
    `{"object": "error", "message": ...}`), else the body's start."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    err = body.get("error", body) if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else err
    return str(message) if message else raw[:200].decode(errors="replace")


def read_event(data: bytes) -> dict:
    """One `data:` payload of the stream, checked to be the object vLLM sends (choices of
    text and token ids, a usage). UpstreamFailed for an error event and for anything else
    (an array, a number, a string, a field of the wrong type): either way the replica is
    failing, and the turn moves on as for any other replica error."""
    event = orjson.loads(data)  # not JSON: orjson's ValueError, the same replica failure
    if not isinstance(event, dict):
        raise UpstreamFailed(f"a malformed event (not a JSON object): {data[:80]!r}")
    if event.get("error") is not None or event.get("object") == "error":
        raise UpstreamFailed(upstream_message(data))
    choices, usage = event.get("choices") or [], event.get("usage")
    if not (
        isinstance(choices, list)
        and all(_is_choice(c) for c in choices)
        and (usage is None or _is_usage(usage))
    ):
        raise UpstreamFailed(f"a malformed event: {data[:80]!r}")
    return event


def _is_choice(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    ids = choice.get("token_ids")
    return (
        _is_optional(choice.get("text"), str)
        and _is_optional(choice.get("finish_reason"), str)
        and (ids is None or (isinstance(ids, list) and all(type(i) is int for i in ids)))
    )


def _is_usage(usage: object) -> bool:
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    return _is_optional(usage.get("completion_tokens"), int) and (
        details is None
        or (isinstance(details, dict) and _is_optional(details.get("cached_tokens"), int))
    )


def _is_optional(value: object, kind: type) -> bool:
    return value is None or (isinstance(value, kind) and not isinstance(value, bool))


def sse_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the complete lines in `buffer`, and the incomplete rest. Read
    from raw bytes, not httpx's `aiter_lines` (three generators and a text decoder per
    chunk); a line is only parsed once whole, so a character split between chunks is too."""
    *lines, rest = buffer.split(b"\n")
    return [line[5:].strip() for line in lines if line.startswith(b"data:")], rest


def rejection(status: int, message: str) -> type[CrowdchatError]:
    """What a 4xx from the upstream is here: a prompt too long, or another bad request."""
    lowered = message.lower()
    if "context length" in lowered or "too long" in lowered or "max_model_len" in lowered:
        return PromptTooLong
    return InvalidRequest


def cache_salt(key: bytes, namespace: str | None) -> str | None:
    """vLLM's per-request `cache_salt` for a prefix-cache namespace (a user): its prefix cache
    then shares blocks only between requests of one salt, so one user's cached conversation
    never shortens another's time to first token (which would tell them what it said). An
    HMAC under the server's own key: nobody who can reach the replicas directly can compute a
    user's salt. vLLM salts a request whole (the first block's hash), so unlike the built-in
    engine an operator-shared system prompt is cached once per user, not once for all."""
    if namespace is None:
        return None
    return base64.urlsafe_b64encode(hmac.new(key, namespace.encode(), "sha256").digest()).decode()


def completion_body(
    model: str,
    ids: list[int],
    p: SamplingParams,
    max_model_len: int,
    stream_interval: int = 1,
    salt: str | None = None,
) -> dict[str, Any]:
    """The `/v1/completions` request: the prompt as token ids, sampling mapped 1:1, the reply
    budget cut to the context left (vLLM refuses more; the built-in engine stops there), how
    many tokens one streamed chunk may carry (vLLM 0.32 reads it; servers that do not know
    the field ignore it) and the prefix cache's salt (`cache_salt`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM >= 0.10.2; others ignore it and we count chunks
        "max_tokens": max(1, min(p.max_new_tokens, max_model_len - len(ids))),
        "temperature": p.temperature,
        "top_p": p.top_p,
    }
    extra = {
        "top_k": p.top_k or None,
        "min_tokens": p.min_new_tokens or None,
        "seed": p.seed,
        "stop": list(p.stop) or None,
        "ignore_eos": p.ignore_eos or None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1 else None,
        "stream_interval": stream_interval if stream_interval > 1 else None,
        "cache_salt": salt,
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


async def stream_turn(
    client: httpx.AsyncClient,
    router: Router,
    replica: Replica,
    handle: RequestHandle,
    body: dict,
    metrics: Metrics,
    timeouts: tuple[float, float],
) -> Outcome:
    """Stream `body` from `replica` into `handle`. Connection errors and 5xx before the first
    token mark the replica down and return RETRY; after it the turn fails with what was
    received kept. A cancel (CancelledError) leaves `client.stream`, which closes the
    connection: vLLM aborts a request whose connection closed."""
    first_token_s, idle_s = timeouts
    slack = min(idle_s / 20, 1.0)
    loop = asyncio.get_running_loop()
    started = last = time.monotonic()
    streamed, reason, usage = False, FinishReason.STOP, None
    try:
        async with asyncio.timeout(first_token_s) as deadline:
            async with client.stream("POST", f"{replica.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    message = upstream_message(await resp.aread())
                    if resp.status_code >= 500 or resp.status_code == 408:
                        router.done(replica, False, f"HTTP {resp.status_code}: {message}")
                        return Outcome.RETRY
                    router.done(replica, True)
                    kind = rejection(resp.status_code, message)
                    if resp.status_code == 429:
                        kind = ServerBusy
                        message = f"the model server is busy ({message}); try again in a moment"
                    handle._finish(FinishReason.ERROR, message, kind)
                    return Outcome.DONE
                handle.admitted = True
                rest, ended, chunks = b"", False, resp.aiter_raw()
                async for chunk in chunks:
                    lines, rest = sse_lines(rest + chunk)
                    for data in lines:
                        if data == b"[DONE]":
                            ended = True
                            break
                        event = read_event(data)
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or ():
                            text, ids = choice.get("text") or "", choice.get("token_ids") or ()
                            if text or ids:
                                now = time.monotonic()
                                handle.token_ids.extend(ids or (-1,))  # -1: an id not sent
                                handle._push(text)
                                gap = now - (last if streamed else started)
                                _record(
                                    metrics, gap / max(len(ids), 1) if streamed else gap, streamed
                                )
                                metrics.record_tokens(now, len(ids) or 1)
                                streamed, last = True, now
                            reason = FINISH.get(choice.get("finish_reason") or "", reason)
                    if ended:
                        break
                    # a timer cancelled and re-made per token was a measurable share of the
                    # relay's CPU: move it only when it falls short of idle_s from now (or is
                    # far beyond, the first token's), to `slack` past that: a silent stream
                    # fails after idle_s to idle_s + slack, never sooner
                    target, when = loop.time() + idle_s, deadline.when() or 0.0
                    if target > when or target < when - 2 * slack:
                        deadline.reschedule(target + slack)
                if ended:
                    await _read_to_end(chunks)
    except TimeoutError:
        why = f"no token for {idle_s:.0f} s" if streamed else f"no answer in {first_token_s:.0f} s"
        router.done(replica, True)  # slow is not down: the health check decides that
        message = (
            MID_REPLY.format(why=why)
            if streamed
            else f"the model server did not start answering ({why}); try again in a moment"
        )
        handle._finish(FinishReason.ERROR, message)
        return Outcome.DONE
    except (httpx.HTTPError, UpstreamFailed, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        router.done(replica, False, why)
        if not streamed:
            return Outcome.RETRY
        handle._finish(FinishReason.ERROR, MID_REPLY.format(why=why))
        return Outcome.DONE
    except asyncio.CancelledError:
        router.done(replica, True)
        raise
    router.done(replica, True)
    _settle(handle, usage, metrics)
    handle._finish(reason, None if reason is not FinishReason.ERROR else "the upstream aborted it")
    return Outcome.DONE


async def _read_to_end(chunks: AsyncIterator[bytes]) -> None:
    """After `[DONE]` the body's end comes next: read it, so the connection goes back to the
    pool for the next turn (closing it mid-body cost a new connection per turn, about 7% of
    the front end's CPU at 4-token replies). Bounded: an upstream that keeps the stream
    open after `[DONE]` only loses its connection."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in chunks:
                pass


def _record(metrics: Metrics, gap: float, streamed: bool) -> None:
    """TTFT for the first token, ITL for the rest (the engine's histograms, same buckets)."""
    with metrics.lock:
        if streamed:
            metrics.itl.append(gap)
            metrics.itl_hist.observe(gap)
        else:
            metrics.ttft.append(gap)
            metrics.ttft_hist.observe(gap)


def _settle(handle: RequestHandle, usage: dict | None, metrics: Metrics) -> None:
    """The final usage chunk: generated tokens (when ids were not sent) and the prompt
    tokens the upstream's prefix cache already held (vLLM: --enable-prompt-tokens-details)."""
    if not usage:
        return
    missing = int(usage.get("completion_tokens") or 0) - len(handle.token_ids)
    handle.token_ids.extend([-1] * max(missing, 0))
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    handle.num_cached_tokens = handle.num_hit_tokens = min(cached, handle.num_prompt_tokens)
    with metrics.lock:
        metrics.prompt_tokens += handle.num_prompt_tokens - handle.num_cached_tokens
