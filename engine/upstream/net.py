"""The upstream client's sockets as plain asyncio streams under httpcore (its public network
backend seam), instead of its anyio backend.

Why: relaying a token from an upstream stream costs one socket read, and the anyio backend
spends most of that read on bookkeeping (a cancel scope per read even without a timeout, and
reading paused and resumed on the transport, two `epoll_ctl` calls, per chunk): py-spy put
that read at about a fifth of the front end's CPU relaying 64-token replies (docs/SCALE.md).
An asyncio StreamReader wakes its reader from the buffer the transport fills, with no timer
unless a timeout is asked for.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

SocketOption = tuple[int, int, int | bytes] | tuple[int, int, None, int]


def _readable(sock: socket.socket | None) -> bool:
    """Data or EOF waiting (an idle keep-alive connection the server has closed)."""
    if sock is None or sock.fileno() < 0:
        return True
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection: httpcore's reads and writes on an asyncio reader and writer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError as e:
            raise httpcore.ReadTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ReadError(str(e) or type(e).__name__) from e

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
        except TimeoutError as e:
            raise httpcore.WriteTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.WriteError(str(e) or type(e).__name__) from e

    async def aclose(self) -> None:
        self._writer.close()  # no wait for the peer: a cancelled turn must not linger here

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError as e:
            self._writer.close()
            raise httpcore.ConnectTimeout(str(e)) from e
        except (OSError, ssl.SSLError) as e:
            self._writer.close()
            raise httpcore.ConnectError(str(e) or type(e).__name__) from e
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._reader.at_eof() or _readable(self._writer.get_extra_info("socket"))
        name = {"client_addr": "sockname", "server_addr": "peername"}.get(info, info)
        if name in ("ssl_object", "sockname", "peername", "socket"):
            return self._writer.get_extra_info(name)
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's connections opened with `asyncio.open_connection` (TCP_NODELAY is
    asyncio's default)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        local = (local_address, 0) if local_address else None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port, local_addr=local)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ConnectError(str(e) or type(e).__name__) from e
        sock = writer.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ConnectError(str(e) or type(e).__name__) from e
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def asyncio_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's own transport (its error mapping, its pool) over AsyncioBackend. httpx takes
    no network backend, so its pool is replaced by the same pool with one."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    if not isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        return transport  # another httpx inside: its own backend, slower but correct
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return transport
