"""Issue 57, defect 1: another site's page cannot drive any door with a visitor's cookies. A
real Chromium on a page of a second origin tries the admin page's "Delete session" with the
admin's sign-in; header-level tests cover every door that changes something, the CORS
headers and the cookies' SameSite."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from bench.server import free_port
from engine.model.loader import LoadedModel
from tests.browser_rig import CHROMIUM, FLAGS, log_in
from tests.web import ADMIN_PASSWORD, running_server

SITE, EVIL = "chat.example.com", "evil.example"  # both 127.0.0.1 in the test's Chromium
FOREIGN = {"Host": SITE, "Origin": f"https://{EVIL}"}


@pytest.fixture(scope="module")
def served(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with running_server(nf4_model, tmp_path_factory.mktemp("cross")) as running:
        yield running


def admin_client(url: str) -> httpx.Client:
    http = httpx.Client(base_url=url, timeout=60, headers={"Host": SITE})
    r = http.post("/admin/login", data={"username": "admin", "password": ADMIN_PASSWORD})
    assert r.status_code == 200
    return http


def delete_fn(http: httpx.Client) -> str:
    """The api name of the admin page's "Delete session" (the third action on the session id
    box: persist, drop, delete)."""
    config = http.get("/admin/config").json()
    box = next(
        c["id"]
        for c in config["components"]
        if c.get("props", {}).get("label", "").startswith("Session id")
    )
    return [d["api_name"] for d in config["dependencies"] if d["inputs"] == [box]][2]


def test_a_preflight_from_another_site_is_refused_and_no_door_echoes_its_origin(
    served: tuple,
) -> None:
    url, _, _ = served
    http = admin_client(url)
    fn = delete_fn(http)
    ask = {**FOREIGN, "Access-Control-Request-Method": "POST"}
    for path in (f"/admin/gradio_api/call/{fn}", "/gradio_api/queue/join", "/v1/models"):
        r = http.options(path, headers=ask)
        assert r.status_code == 403, path
        assert "access-control-allow-origin" not in r.headers
    for path in ("/admin/config", "/config", "/v1/models", "/health"):
        r = http.get(path, headers=FOREIGN)
        assert not any(k.startswith("access-control-") for k in r.headers), path


def test_the_admin_action_with_the_admin_cookie_from_another_site_is_refused(
    served: tuple,
) -> None:
    url, _, sm = served
    sid = sm.create_session("browser:victim", "keep me")["id"]
    http = admin_client(url)
    fn = delete_fn(http)
    refused = [{"Sec-Fetch-Site": s} for s in ("cross-site", "same-site")] + [{"Origin": "null"}]
    for foreign in [FOREIGN, *({"Host": SITE, **h} for h in refused)]:
        r = http.post(f"/admin/gradio_api/call/{fn}", json={"data": [sid]}, headers=foreign)
        assert r.status_code == 403, foreign
        assert sm.store.get_session(sid) is not None
    # the same call from the admin page itself still works
    own = {"Host": SITE, "Origin": f"http://{SITE}", "Sec-Fetch-Site": "same-origin"}
    r = http.post(f"/admin/gradio_api/call/{fn}", json={"data": [sid]}, headers=own)
    assert r.status_code == 200
    event = r.json()["event_id"]
    assert "deleted" in http.get(f"/admin/gradio_api/call/{fn}/{event}", headers=own).text
    assert sm.store.get_session(sid) is None


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/gradio_api/queue/join"),
        ("POST", "/gradio_api/upload"),
        ("POST", "/gradio_api/run/predict"),
        ("POST", "/share/abcdefghijklmnopqrstuvwxyz/copy"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/sessions/import"),
        ("POST", "/v1/sessions"),
        ("DELETE", "/v1/sessions/0123456789abcdef0123456789abcdef"),
        ("POST", "/admin/login"),
        ("POST", "/login"),
    ],
)
def test_every_door_refuses_a_state_change_from_another_site(
    served: tuple, method: str, path: str
) -> None:
    url, _, _ = served
    for foreign in (FOREIGN, {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.request(method, url + path, headers=foreign, content=b"{}")
        assert r.status_code == 403, (foreign, r.text)
        assert "another site" in r.text


def test_requests_without_browser_headers_or_from_the_same_origin_pass(served: tuple) -> None:
    url, _, _ = served
    hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    host = url.removeprefix("http://")
    own = [{}, {"Origin": url}, {"Sec-Fetch-Site": "same-origin", "Origin": "x"},
           {"Sec-Fetch-Site": "none"}, {"Origin": f"HTTP://{host.upper()}"}]  # fmt: skip
    for headers in own:
        assert httpx.post(f"{url}/v1/chat/completions", json=hi, headers=headers).status_code == 200


def test_every_cookie_the_server_sets_is_same_site_lax(served: tuple) -> None:
    url, _, _ = served
    cookies = httpx.post(
        f"{url}/admin/login", data={"username": "admin", "password": ADMIN_PASSWORD}
    ).headers.get_list("set-cookie")
    cookies += httpx.get(f"{url}/config").headers.get_list("set-cookie")  # crowdchat_id
    assert len(cookies) == 3
    for cookie in cookies:
        assert "samesite=lax" in cookie.lower() and "samesite=none" not in cookie.lower()


ATTACK = """<!doctype html><title>waiting</title><script>
async function attack(url, fn, sid) {
  try {
    const r = await fetch(`${url}/admin/gradio_api/call/${fn}`, {method: "POST",
      credentials: "include", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({data: [sid]})});
    const {event_id} = await r.json();
    const s = await fetch(`${url}/admin/gradio_api/call/${fn}/${event_id}`,
                          {credentials: "include"});
    return "read: " + await s.text();
  } catch (e) { return "blocked: " + e; }
}
</script>"""


class AttackPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(ATTACK.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_a_page_of_another_origin_in_chromium_cannot_delete_a_session_as_the_admin(
    served: tuple, tmp_path: Path
) -> None:
    url, _, sm = served
    port = url.rsplit(":", 1)[1]
    site = f"http://{SITE}:{port}"
    sid = sm.create_session("browser:victim", "keep me")["id"]
    fn = delete_fn(admin_client(url))
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), AttackPage)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    rules = f"--host-resolver-rules=MAP {SITE} 127.0.0.1, MAP {EVIL} 127.0.0.1"
    # the admin page's origin counts as secure, so its Secure cookie is kept over http
    secure = f"--unsafely-treat-insecure-origin-as-secure={site}"
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, args=[*FLAGS, rules, secure], headless=True
            )
            context = browser.new_context()
            page = context.new_page()
            page.goto(site + "/admin/")
            log_in(page, "admin", ADMIN_PASSWORD)
            page.locator("#memory").wait_for(timeout=20_000)  # signed in
            page.goto(f"http://{EVIL}:{evil.server_port}/")
            said = page.evaluate(f"attack({site!r}, {fn!r}, {sid!r})")
            browser.close()
    finally:
        evil.shutdown()
    assert said.startswith("blocked"), said
    assert sm.store.get_session(sid) is not None
