"""Issue 57, defect 4: each user's storage quota in bytes, which imports, share links and
messages all count against, shown in /v1/usage's data and on the page's usage line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.model.loader import LoadedModel
from sessions.errors import RateLimited
from tests.conftest import close_sessions, make_sessions
from tests.transfer_rig import crowdchat_export
from ui.status_line import usage_text

GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def test_imports_shares_and_messages_count_against_one_quota_in_bytes(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, max_storage_mb_per_user=0.0025)  # 2,500 B
    try:
        doc = crowdchat_export()
        doc["conversations"][0]["messages"][0]["content"] = "x" * 1100
        sm.import_file("kim", json.dumps(doc).encode())
        used = sm.usage("kim")["storage_bytes"]
        assert 1100 < used < 1200 and sm.usage("kim")["max_storage_bytes"] == 2500
        assert "· 0.0 of 0 MB kept ·" in usage_text(sm.usage("kim"))
        sid = sm.list_sessions("kim")[0]["id"]
        sm.share("kim", sid)  # the link's copy counts too
        assert sm.usage("kim")["storage_bytes"] > 2200
        with pytest.raises(RateLimited, match="the link needs"):
            sm.share("kim", sid)
        with pytest.raises(RateLimited, match="the file needs.*--max-storage-mb-per-user"):
            sm.import_file("kim", json.dumps(doc).encode())
        with pytest.raises(RateLimited, match="a new message"):
            for _ in range(20):  # each turn adds its message and reply, until the quota
                sm.chat("kim", sid, "y" * 100, GREEDY).result()
        assert sm.usage("ned")["storage_bytes"] == 0  # another user's is their own
    finally:
        close_sessions(engine, sm)
