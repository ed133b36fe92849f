"""The engine's lock-free token hand-off to `RequestHandle` (issue 58): the producer appends to
`token_ids` without the handle's lock and wakes a handle only when its reader waits. With real
threads (and an asyncio reader) every token reaches its reader once, in order, and a waiting
reader is woken."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engine.handle import RequestHandle
from engine.sequence import FinishReason

WAIT_S = 10.0


class Labels:
    """A decoder whose text names each token, so the text read proves which tokens arrived,
    how many times and in what order."""

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return "|"


def reading(handle: RequestHandle) -> RequestHandle:
    handle._detok = Labels()
    return handle


def labels(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


def wait_until(cond, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.0005)


def test_a_waiting_reader_is_woken_by_a_step_with_no_end() -> None:
    h = reading(RequestHandle(1, 4, lambda _: None))
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(h), daemon=True)
    reader.start()
    wait_until(lambda: h.reader_waiting, "the reader never waited")
    h.token_ids.append(7)  # the engine thread's hand-off, as OutputProcessor does it
    assert h.reader_waiting  # it still waits: the wake-up is what moves it
    h.wake_reader()
    wait_until(lambda: got, "a waiting reader was not woken")
    assert got == ["<7>"]
    h._finish(FinishReason.LENGTH)
    reader.join(WAIT_S)
    assert not reader.is_alive() and "".join(got) == "<7>|" and h.text == "<7>|"


def test_a_stop_token_is_counted_but_never_decoded() -> None:
    h = reading(RequestHandle(1, 4, lambda _: None))
    h.token_ids += [3, 4]
    h._finish(FinishReason.STOP, last_token=2)
    assert h.result() == "<3><4>|" and h.token_ids == [3, 4, 2]


@pytest.mark.parametrize("seed", [0, 1, 2, 58])
def test_every_token_arrives_once_in_order_with_concurrent_readers(seed: int) -> None:
    """One producer thread runs "steps" over many handles (a random subset a step, random
    pauses, some ended by a stop token); thread readers and asyncio readers on a loop of their
    own consume at random speeds. Each reader's text is its tokens' labels, each once, in order."""
    rng = random.Random(seed)
    n = 24
    handles = [reading(RequestHandle(i, 4, lambda _: None)) for i in range(n)]
    want: list[list[int]] = [[] for _ in range(n)]
    texts: list[str | None] = [None] * n
    errors: list[BaseException] = []
    pauses = [rng.choice([0, 0, 0.0002, 0.002]) for _ in range(n)]

    def read_thread(i: int) -> None:
        try:
            parts = []
            for part in handles[i]:
                parts.append(part)
                time.sleep(pauses[i])
            texts[i] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - the test asserts there were none
            errors.append(e)

    async def read_async(i: int) -> None:
        parts = []
        while part := await handles[i].next_batch():
            parts.append(part)
            await asyncio.sleep(pauses[i])
        texts[i] = "".join(parts)

    async def read_all_async() -> None:
        await asyncio.gather(*(read_async(i) for i in async_ids))

    async_ids = [i for i in range(n) if i % 3 == 0]
    loop_thread = threading.Thread(target=lambda: asyncio.run(read_all_async()), daemon=True)
    readers = [
        threading.Thread(target=read_thread, args=(i,), daemon=True)
        for i in range(n)
        if i not in async_ids
    ]
    for t in [*readers, loop_thread]:
        t.start()

    live = set(range(n))
    token = 100
    wakes = 0
    while live:
        woken = []
        ended = []
        for i in sorted(live):
            if rng.random() < 0.3:
                continue  # not in this step
            token += 1
            h = handles[i]
            if rng.random() < 0.02:  # a stop token: counted, not shown
                ended.append((i, token))
                continue
            h.token_ids.append(token)
            want[i].append(token)
            if h.reader_waiting:
                woken.append(h)
            if len(want[i]) >= 60:
                ended.append((i, None))
        wakes += len(woken)
        for h in woken:
            h.wake_reader()
        for i, stop in ended:
            reason = FinishReason.LENGTH if stop is None else FinishReason.STOP
            handles[i]._finish(reason, last_token=stop)
            live.discard(i)
        time.sleep(rng.choice([0, 0, 0.0001, 0.001]))

    for t in [*readers, loop_thread]:
        t.join(WAIT_S)
        assert not t.is_alive(), "a reader waits forever: a wake-up was lost"
    assert not errors and wakes > 0  # readers did wait mid-reply, and were woken
    for i in range(n):
        assert texts[i] == labels(want[i]) + "|", i
        assert handles[i].text == texts[i]
