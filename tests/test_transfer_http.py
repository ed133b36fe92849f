"""Export and import over HTTP: the API's routes and the chat page's download links serve the
caller's own conversations only, and the import body cap is --max-import-mb."""

from __future__ import annotations

import json

import httpx
import pytest

from doors.browser_id import COOKIE
from engine.model.loader import LoadedModel
from tests.web import bearer, running_server

MB = 1_000_000


@pytest.fixture(scope="module")
def server(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("ann:key-ann-0123456789ab\nben:key-ben-0123456789ab\n")
    apps: list = []
    with running_server(
        nf4_model,
        tmp_path_factory.mktemp("transfer-http"),
        apps=apps,
        api_keys_file=keys,
        session_overrides={"max_import_mb": 2.0},
    ) as (url, _engine, sm):
        yield url, sm, apps[0]


def test_the_api_exports_imports_and_keeps_each_users_own(server) -> None:  # noqa: ANN001
    url, _sm, _app = server
    ann, ben = bearer("key-ann-0123456789ab"), bearer("key-ben-0123456789ab")
    with httpx.Client(base_url=url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"title": "Figs"}, headers=ann).json()["id"]
        chat = {"messages": [{"role": "user", "content": "Hello figs"}], "max_tokens": 4}
        r = http.post("/v1/chat/completions", json=chat, headers={**ann, "X-Session-Id": sid})
        assert r.status_code == 200
        md = http.get(f"/v1/sessions/{sid}/export?format=markdown", headers=ann)
        assert md.status_code == 200 and "## You\n\nHello figs" in md.text
        assert md.headers["content-disposition"] == (
            "attachment; filename=\"Figs.md\"; filename*=UTF-8''Figs.md"
        )
        # a title in another script still names the file (in filename*), never a 500
        kyoto = http.post("/v1/sessions", json={"title": "京都 trip"}, headers=ann).json()["id"]
        named = http.get(f"/v1/sessions/{kyoto}/export", headers=ann)
        assert named.status_code == 200
        assert named.headers["content-disposition"].endswith("%E4%BA%AC%E9%83%BD-trip.json")
        one = http.get(f"/v1/sessions/{sid}/export", headers=ann).json()
        assert one["format"] == "crowdchat" and one["conversations"][0]["title"] == "Figs"
        assert http.get(f"/v1/sessions/{sid}/export?format=pdf", headers=ann).status_code == 400
        # ben can neither read nor export ann's conversation: the same 404 as no conversation
        for path in (f"/v1/sessions/{sid}/export", f"/v1/sessions/{sid}"):
            assert http.get(path, headers=ben).status_code == 404
        imported = http.post("/v1/sessions/import", content=json.dumps(one), headers=ben)
        assert imported.status_code == 200, imported.text
        copy = imported.json()["data"][0]["id"]
        assert (
            copy != sid and http.get(f"/v1/sessions/{copy}", headers=ben).json()["title"] == "Figs"
        )
        everything = http.get("/v1/sessions/export", headers=ben).json()["conversations"]
        assert [c["title"] for c in everything] == ["Figs"]
        bad = http.post("/v1/sessions/import", content=b"[1]", headers=ben)
        assert bad.status_code == 400 and "neither" in bad.json()["error"]["message"]
        # past --max-import-mb (2 MB here) the door refuses it unread, naming the flag
        big = http.post("/v1/sessions/import", content=b" " * (3 * MB), headers=ben)
        assert big.status_code == 413 and "--max-import-mb" in big.text
        # every other route keeps the 1 MB body cap
        over = b" " * ((1 << 20) + 10)
        assert http.post("/v1/sessions", content=over, headers=ben).status_code == 413


def test_the_pages_download_links_serve_the_cookies_owner_only(server) -> None:  # noqa: ANN001
    url, sm, app = server
    with httpx.Client(base_url=url, timeout=60) as one, httpx.Client(base_url=url) as two:
        for client in (one, two):
            assert client.get("/").status_code == 200  # the door mints the browser's cookie
        owner = "browser:" + app.state.doors.browser_ids.verify(one.cookies[COOKIE])
        sid = sm.create_session(owner, "Quinces")["id"]
        sm.store.add_message(sid, "user", "quince jam?")
        assert "## You\n\nquince jam?" in one.get(f"/export/{sid}.md").text
        assert one.get(f"/export/{sid}.json").json()["conversations"][0]["title"] == "Quinces"
        assert one.get("/export/all.json").json()["conversations"][0]["title"] == "Quinces"
        assert one.get(f"/export/{sid}.exe").status_code == 404
        # another browser gets nothing of it, and its "all" holds only its own (none)
        for name in (f"{sid}.md", f"{sid}.json"):
            assert two.get(f"/export/{name}").status_code == 404
        assert two.get("/export/all.json").json()["conversations"] == []
        # nor does a client without the cookie: it is a new browser
        assert httpx.get(f"{url}/export/{sid}.md").status_code == 404
