"""The admin page marks a system prompt shared, over HTTP on the real server: every user's
conversation under it then starts from the same cached blocks; a restart keeps the mark;
removing it stops the sharing."""

from __future__ import annotations

from pathlib import Path

import httpx
from gradio_client import Client

from engine.model.loader import LoadedModel
from tests.web import ADMIN_PASSWORD, PROXY, client_at, running_server

SYSTEM_TEXT = (
    "You are the assistant of the Riverside team. Answer briefly, kindly and precisely. "
    "The team builds bridges, tunnels and harbours, and its people like short answers. " * 3
)
TURN = {"messages": [{"role": "user", "content": "Name one harbour."}], "max_tokens": 4}


def kv_of(url: str, user: str, system_prompt: str = SYSTEM_TEXT) -> str:
    """A new conversation of `user` (an API client at an address of its own) under the system
    prompt: where its first turn's KV came from (the X-Crowdchat-KV header)."""
    auth = client_at(user)
    with httpx.Client(base_url=url, timeout=120, headers=auth) as http:
        r = http.post("/v1/sessions", json={"system_prompt": system_prompt})
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        r = http.post("/v1/chat/completions", json=TURN, headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        return r.headers["x-crowdchat-kv"]


def admin(url: str) -> Client:
    return Client(url + "/admin/", auth=("admin", ADMIN_PASSWORD), verbose=False)


def test_an_admin_shares_a_system_prompt_a_restart_keeps_it_and_removing_it_stops_it(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with running_server(nf4_model, data, trusted_proxy=PROXY) as (url, _engine, sm):
        assert kv_of(url, "ann-key") == "cold"
        assert kv_of(url, "bob-key") == "cold"  # not shared yet: ann's blocks are hers
        note, _table, box = admin(url).predict(SYSTEM_TEXT, api_name="/share_prompt")
        assert note.startswith("Shared as prompt") and box == ""
        assert kv_of(url, "cid-key") == "cold"  # the first one under the mark computes it
        assert kv_of(url, "dan-key") == "cached"  # everyone else starts from its blocks
        assert kv_of(url, "eve-key", "You answer in French.") == "cold"  # others stay private
        empty, _table, _box = admin(url).predict("   ", api_name="/share_prompt")
        assert "empty" in empty
        [row] = sm.shared_prompts.list()
    with running_server(nf4_model, data, trusted_proxy=PROXY) as (url, _engine, sm):
        assert [r["text"] for r in sm.shared_prompts.list()] == [row["text"]]
        assert kv_of(url, "fay-key") == "cold"
        assert kv_of(url, "gus-key") == "cached"  # the restart kept the mark
        note, _table = admin(url).predict(row["id"], api_name="/unshare_prompt")
        assert "no longer shared" in note
        assert sm.shared_prompts.list() == []
        assert kv_of(url, "hal-key") == "cold"
        assert kv_of(url, "ivy-key") == "cold"  # removed: nothing is shared any more
