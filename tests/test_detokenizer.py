"""Reply text from token ids: tokenizers' own incremental decoder gives exactly the text the
decode-twice path gave, and the engine thread decodes only replies with stop strings (the rest
are decoded by their readers, off the step's critical path)."""

from __future__ import annotations

import random
import threading

import pytest

from engine import SamplingParams
from engine.chat_format import ChatFormatter
from engine.core.detokenizer import IncrementalDetokenizer
from tests.fake_model import FakeTokenizer, fake_engine

TEXT = "Hello there! Ünïcödé 😀 日本語 text, with  spaces.\n\nNew para — «quotes» ∑ 🚀"


def test_the_incremental_decoder_streams_the_decode_twice_text(local: tuple) -> None:
    """Random replies (real words, multi-byte characters split over tokens, random ids) after
    a chat prompt, with and without stop strings: the same deltas, delta for delta, from
    `tokenizers.decoders.DecodeStream` as from transformers' `decode` twice a token."""
    tokenizer = local[0]
    fmt = ChatFormatter(tokenizer)
    words = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(60):
        ids = [
            rng.choice(words) if rng.random() < 0.7 else rng.randrange(len(tokenizer))
            for _ in range(30)
        ]
        prompt = fmt.encode([{"role": "user", "content": f"question {trial}"}])
        stop = rng.choice([(), ("e",), ("the", "\n\n")])
        fast = IncrementalDetokenizer(tokenizer, prompt, stop)
        slow = IncrementalDetokenizer(tokenizer, prompt, stop)
        assert fast.stream is not None
        slow.stream = None  # the decode-twice path
        got = [fast.push(t) for t in ids] + [fast.flush()]
        assert got == [slow.push(t) for t in ids] + [slow.flush()]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if not stop and not whole.endswith("\ufffd"):  # (a split last character: held back)
            assert "".join(got) == whole


def test_the_engine_thread_decodes_only_replies_with_stop_strings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply without stop strings is decoded on its reader's thread (the same text); one
    with stop strings still on the engine thread, which must see a stop before the next step."""
    where: list[str] = []
    decode = FakeTokenizer.decode

    def recorded(self: FakeTokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
        where.append(threading.current_thread().name)
        return decode(self, ids, skip_special_tokens)

    monkeypatch.setattr(FakeTokenizer, "decode", recorded)
    engine, _ = fake_engine(num_blocks=64)
    try:
        plain = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=12, ignore_eos=True))
        streamed = "".join(plain)
        assert streamed == plain.text == FakeTokenizer().decode(plain.token_ids)
        assert where and "crowdchat-engine" not in where
        where.clear()
        stop = FakeTokenizer().decode(plain.token_ids[4:6])
        stopped = engine.submit(
            [5, 6, 7], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,))
        )
        assert stopped.result() == streamed[: streamed.find(stop)]
        assert "crowdchat-engine" in where
    finally:
        engine.check_integrity()
        engine.shutdown()
