"""Issue 57, defect 5 and the import rate (defect 4): an upload needs an identity that existed
before it, counts against that identity's --imports-per-minute with the API's imports, and is
deleted after --upload-keep-s whether or not an import follows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.model.loader import LoadedModel
from tests.web import running_server

FILE = {"files": ("conversations.json", b'{"format": "nothing"}', "application/json")}
KEEP_S = 2


@pytest.fixture(scope="module")
def served(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(
        nf4_model,
        tmp_path_factory.mktemp("uploads"),
        upload_keep_s=KEEP_S,
        imports_per_minute=3,
    ) as (url, _engine, _sm):
        yield url


def test_an_upload_without_an_identity_is_refused_and_keeps_nothing(served: str) -> None:
    r = httpx.post(f"{served}/gradio_api/upload", files=FILE)
    assert r.status_code == 401 and "chat page first" in r.text
    assert "set-cookie" not in r.headers


def test_an_abandoned_upload_is_gone_after_the_bound_and_uploads_are_rationed(
    served: str,
) -> None:
    with httpx.Client(base_url=served, timeout=60) as browser:
        assert browser.get("/config").status_code == 200  # the page gives the cookie
        r = browser.post("/gradio_api/upload", files=FILE)
        assert r.status_code == 200, r.text
        path = Path(r.json()[0])
        assert path.is_file()
        codes = [browser.post("/gradio_api/upload", files=FILE).status_code for _ in range(3)]
        assert codes == [200, 200, 429]  # the fourth file of the minute
        deadline = time.monotonic() + KEEP_S + 60
        while path.exists() and time.monotonic() < deadline:  # no import ever follows
            time.sleep(0.5)
        assert not path.exists()
    # another identity (the open API's client address) has its own files to count
    imported = httpx.post(f"{served}/v1/sessions/import", content=b"{}")
    assert imported.status_code == 400  # read and refused as no export, not rationed
