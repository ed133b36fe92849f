"""The address the server prints at start, /admin (no slash), opens the admin page in every
mode: the admin password, --auth (an admin signed in), and disabled (the same message as
/admin/). Over HTTP against the real server."""

from __future__ import annotations

from pathlib import Path

import httpx

from engine.model.loader import LoadedModel
from tests.test_doors import add_user, signed_in
from tests.web import ADMIN_PASSWORD, running_server


def test_admin_without_its_slash_opens_the_password_admin_page(server: tuple) -> None:
    url, _, _ = server
    with httpx.Client(base_url=url, follow_redirects=True, timeout=60) as http:
        for path in ("/admin", "/admin/"):
            r = http.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
            assert str(r.url).endswith("/admin/") and "crowdchat admin" in r.text
        ok = http.post("/admin/login", data={"username": "admin", "password": ADMIN_PASSWORD})
        assert ok.status_code == 200
        r = http.get("/admin")
        assert r.status_code == 200 and '"title": "crowdchat admin"' in r.text.replace(
            '":"', '": "'
        )


def test_admin_without_its_slash_with_sign_in_and_disabled(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users = tmp_path / "users.txt"
    add_user(users, "ann")
    add_user(users, "root", "--admin")
    with running_server(nf4_model, tmp_path / "auth", auth_file=users) as (url, _, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/admin").status_code == 401  # not signed in: the door says so
        with signed_in(url, "ann") as http:
            assert http.get("/admin").status_code == 403
        with signed_in(url, "root") as http:
            for path in ("/admin", "/admin/"):
                r = http.get(path, follow_redirects=True)
                assert r.status_code == 200, (path, r.status_code, r.text[:200])
                assert str(r.url).endswith("/admin/") and "crowdchat admin" in r.text
    with running_server(nf4_model, tmp_path / "off", admin_password=None) as (url, _, _):
        for path in ("/admin", "/admin/"):
            r = httpx.get(url + path, follow_redirects=True, timeout=60)
            assert r.status_code == 404 and "disabled" in r.text, path
