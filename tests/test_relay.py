"""Deltas reach their reader in batches, and an asyncio reader needs no thread per reply: the
handle's async path and AsyncRelay, without a model (a handle fed by hand or by a thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import CrowdchatError, FinishReason, RequestHandle, SamplingParams
from sessions import ChatTurn
from sessions.relay import AsyncRelay, Delta, End, Failed


def live_handle(cancelled: list[int] | None = None) -> RequestHandle:
    return RequestHandle(1, 7, cancel=(cancelled if cancelled is not None else []).append)


def turn_over(handle: RequestHandle, ended: list[ChatTurn]) -> ChatTurn:
    return ChatTurn(
        "s" * 32,
        [1],
        SamplingParams(),
        restore=lambda: "cold",
        submit=lambda p, s: handle,
        queue_position=lambda _h: 0,
        on_end=ended.append,
    )


def test_a_thread_reader_gets_everything_that_arrived_as_one_batch() -> None:
    handle = live_handle()
    for d in ("a", "b", "c"):
        handle._push(d)
    reader = iter(handle)
    assert next(reader) == "abc"
    handle._push("d")
    handle._finish(FinishReason.STOP)
    assert list(reader) == ["d"] and handle.text == "abcd"


def test_an_asyncio_reader_wakes_once_per_batch_and_a_timeout_loses_nothing() -> None:
    async def main() -> None:
        handle = live_handle()
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args):  # noqa: ANN001, ANN202 - wraps the loop's own
            wakes.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(handle.next_batch(), 0.05)  # nothing yet
        producer = threading.Thread(target=lambda: [handle._push(f"t{i} ") for i in range(50)])
        producer.start()
        producer.join()
        assert len(wakes) == 1  # 50 tokens while the reader was busy: one wake-up
        assert await handle.next_batch() == "".join(f"t{i} " for i in range(50))
        threading.Thread(target=handle._finish, args=(FinishReason.LENGTH,)).start()
        assert await handle.next_batch() == ""
        assert len(wakes) <= 2 and handle.finish_reason is FinishReason.LENGTH

        # an engine step's tokens for many streams read on one loop: one wake-up for all
        wakes.clear()
        handles = [live_handle() for _ in range(32)]
        readers = [asyncio.ensure_future(h.next_batch()) for h in handles]
        await asyncio.sleep(0.01)  # every reader waits
        step = threading.Thread(target=lambda: [h._push("tok") for h in handles])
        step.start()
        step.join()
        assert await asyncio.gather(*readers) == ["tok"] * 32 and len(wakes) == 1

    asyncio.run(main())


def test_an_error_finish_raises_to_the_asyncio_reader_after_the_text() -> None:
    async def main() -> None:
        handle = live_handle()
        handle._push("part")
        handle._finish(FinishReason.ERROR, "the model server stopped")
        assert await handle.next_batch() == "part"
        with pytest.raises(CrowdchatError, match="model server stopped"):
            await handle.next_batch()

    asyncio.run(main())


def test_async_relay_streams_a_turn_and_commits_it_before_the_end() -> None:
    async def main() -> None:
        handle, ended = live_handle(), []
        turn = turn_over(handle, ended)
        relay = AsyncRelay(turn)
        threading.Timer(0.05, lambda: (handle._push("Hel"), handle._push("lo"))).start()
        first = await relay.next()
        assert isinstance(first, Delta) and turn.status == "generating"
        text = first.text
        if text != "Hello":
            text += (await relay.next()).text
        threading.Timer(0.05, handle._finish, args=(FinishReason.STOP,)).start()
        assert await relay.next() == End()
        assert ended == [turn] and turn.text == text == "Hello" and turn.finish_reason == "stop"
        assert not any(t.name.startswith("crowdchat-api-reply") for t in threading.enumerate())

    asyncio.run(main())


def test_async_relay_reports_an_error_and_still_commits() -> None:
    async def main() -> None:
        handle, ended = live_handle(), []
        handle._push("x")
        handle._finish(FinishReason.ERROR, "boom")
        relay = AsyncRelay(turn_over(handle, ended))
        assert await relay.next() == Delta("x")
        event = await relay.next()
        assert isinstance(event, Failed) and str(event.error) == "boom"
        assert ended[0].error == "boom" and ended[0].finish_reason == "error"
        assert ended[0].text == "x"

    asyncio.run(main())


def test_a_reader_that_leaves_mid_stream_cancels_and_the_part_is_committed() -> None:
    async def main() -> None:
        cancelled: list[int] = []
        handle, ended = live_handle(cancelled), []
        handle._push("half a ")
        relay = AsyncRelay(turn_over(handle, ended))
        assert await relay.next() == Delta("half a ")
        with pytest.raises(TimeoutError):  # the disconnect poll's timeout: nothing lost
            await asyncio.wait_for(relay.next(), 0.05)
        relay.cancel()  # the client went away
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.02)
        assert set(cancelled) == {1} and ended[0].text == "half a "
        assert ended[0].finish_reason == "cancelled"

    asyncio.run(main())


def test_a_turn_refused_on_submit_fails_and_frees_the_session() -> None:
    async def main() -> None:
        ended: list[ChatTurn] = []

        def refuse(prompt: list[int], params: SamplingParams) -> RequestHandle:
            raise CrowdchatError("server busy")

        turn = ChatTurn(
            "s" * 32,
            [1],
            SamplingParams(),
            restore=lambda: "cold",
            submit=refuse,
            queue_position=lambda _h: None,
            on_end=ended.append,
        )
        event = await AsyncRelay(turn).next()
        assert isinstance(event, Failed) and "server busy" in str(event.error)
        assert ended == [turn] and not turn.accepted and turn.finish_reason == "error"

    asyncio.run(main())
