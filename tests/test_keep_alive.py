"""A kept-alive connection outlives its clients' pools: a client that reuses an idle
connection its pool still holds (httpx keeps one 5 s, aiohttp 15 s, a proxy's upstream pool
often 60 s) never finds it closed under its request, which it saw as a connection read error
(issue 59, item 3: one stream of 600 broke under bench/load.py with think times)."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

from doors.config import AppConfig


def test_an_idle_connection_is_kept_past_the_common_clients_pool_expiry(server) -> None:
    parts = urlsplit(server[0])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200
            r.read()
            time.sleep(6)  # idle past httpx's 5 s (uvicorn's own default closed it at 5 s)
    finally:
        conn.close()


def test_the_server_keeps_connections_longer_than_a_proxys_upstream_pool() -> None:
    assert AppConfig().keep_alive_s > 60  # nginx and AWS load balancers idle out at 60 s
