"""The upstream's idle timeout, whose timer moves at most every `slack` seconds (not per token):
a stream with short gaps is never cut early, a silent one still fails with its message."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine import RequestFailed
from tests.fake_upstream import FakeReplica
from tests.upstream_rig import upstream_server


def test_gaps_under_the_idle_timeout_pass_and_a_longer_silence_fails(
    local: tuple,
    tmp_path: Path,
) -> None:
    replica = FakeReplica("r0", words=12).start()
    try:
        with upstream_server([replica], tmp_path, local, upstream_idle_s=0.6) as s:
            _url, backend, sm, _ = s
            prompt = sm.prompts.encode([{"role": "user", "content": "hi"}], 999)
            replica.delay = 0.3  # 13 chunks over ~4 s, each gap half the idle timeout
            t0 = time.monotonic()
            assert backend.submit(prompt).result().count(" w") == 12
            assert time.monotonic() - t0 > 3.0
            replica.delay = 1.2  # the first token may be slow (its own timeout), not the rest
            handle = backend.submit(prompt)
            with pytest.raises(RequestFailed, match="no token for"):
                handle.result()
            assert handle.text.startswith("[r0]")
    finally:
        replica.stop()
