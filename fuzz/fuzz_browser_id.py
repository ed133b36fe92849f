"""Fuzz the anonymous browser cookie's verifier (doors/browser_id.py `BrowserIds.verify`).

An input's bytes are a `crowdchat_id` cookie value as Starlette hands it over (the Cookie
header decoded as Latin-1, so any of code points 0-255). `verify` returns None, or an id of
32 lowercase hex characters that this server signed: never an exception, and never an id the
input does not carry with its own key's MAC.
"""

from __future__ import annotations

import hashlib
import hmac

import _harness
import atheris

with atheris.instrument_imports(include=["doors.browser_id"]):
    from doors.browser_id import ID, BrowserIds

KEY = _harness.SEED_KEY  # the key the seed cookies were signed with (fuzz/make_corpus.py)
IDS = BrowserIds(KEY, per_minute=1)


def signed(browser_id: str) -> str:
    """The cookie value for `browser_id` under KEY, computed here, not by the code under test."""
    mac = hmac.new(KEY.encode(), b"crowdchat_id:" + browser_id.encode(), hashlib.sha256)
    return f"{browser_id}.{mac.hexdigest()}"


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    value = data.decode("latin-1")
    got = IDS.verify(value)
    if got is not None:
        assert isinstance(got, str) and ID.fullmatch(got) and len(got) == 32, got
        assert value == signed(got), (value, got)
    # a cookie signed here, with the input's first 32 characters as its id, verifies exactly
    # when those are 32 lowercase hex characters
    head = value[:32]
    assert (IDS.verify(signed(head)) == head) == bool(ID.fullmatch(head) and len(head) == 32)


if __name__ == "__main__":
    assert IDS.verify(None) is None
    _harness.main("browser_id", test_one_input)
