"""A lean HTTP/1.1 client for the proxy's hot path: keep-alive connections to local workers.

httpx costs several hundred microseconds per request on this class of machine (its request and
response models, header normalisation, the anyio layers), which is most of the router's latency
budget. This client writes the request line and headers as one bytes object, parses the response
with httptools (the parser uvicorn uses), and hands body chunks over as they arrive.

One `_Conn` is one TCP connection (an asyncio Protocol) used by one request at a time; idle
connections wait in a per-address deque. A connection the worker closed while idle is dropped
when `connection_lost` fires; if the worker closes one just as we reuse it (no response byte
received yet), the error says `retryable` and the proxy retries once on a fresh connection.
Backpressure: reading pauses while more than `_HIGH_WATER` bytes wait for a slow client.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024
_MAX_IDLE_PER_ADDRESS = 64


class UpstreamError(Exception):
    """`retryable`: a reused connection closed before any response byte (retry on a fresh one);
    `never_sent`: the worker provably never read the request: the connection was refused, or it
    was reset before any response byte (the worker's socket closed with the request unread)."""

    def __init__(self, message: str, *, retryable: bool = False, never_sent: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.never_sent = never_sent


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.is_closed = False
        self.is_reused = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._headers_done: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._is_complete = False
        self._keep_alive = False
        self._got_bytes = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._is_paused = False

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"bad HTTP from worker: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if not self._is_complete:
            why = f"connection lost ({exc!r})" if exc else "connection closed by the worker"
            # A reset (or a broken pipe) before any response byte: the worker's side closed with
            # the request unread (a socket closed with unread data, or still in a dead listener's
            # backlog, is reset, where one whose request was read ends with a FIN): it never got it.
            unread = isinstance(exc, ConnectionResetError | BrokenPipeError) and not self._got_bytes
            self._fail(UpstreamError(why, retryable=self.is_reused and not self._got_bytes,
                                     never_sent=unread))

    # ---- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._keep_alive = self.parser.should_keep_alive()  # only valid until the message ends
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and self.transport is not None and not self._is_paused:
            self._is_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._is_complete = True
        self._wake()

    # ---- internals

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        self._error = err
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_exception(err)
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(err)

    def is_dropped(self) -> bool:
        """Whether the worker closed this idle connection (or the worker died) and the loop has
        not read that yet: its socket polled without waiting (urllib3's is_connection_dropped). A
        request is then never sent on it, so a connection to a dead worker fails as refused (the
        crash requeue tells "never sent" from "sent to a worker that died": router.http.forwarding)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))  # an idle keep-alive connection has nothing to read
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()

    # ---- one exchange

    async def exchange(self, head: bytes, body: bytes) -> None:
        """Send a request; return once the response headers are in."""
        loop = asyncio.get_running_loop()
        self.status = 0
        self.headers = []
        self._chunks.clear()
        self._buffered = 0
        self._is_complete = False
        self._keep_alive = False
        self._got_bytes = False
        self._error = None
        self._headers_done = loop.create_future()
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        await self._headers_done

    @property
    def is_complete(self) -> bool:
        return self._is_complete

    def should_keep_alive(self) -> bool:
        return self._is_complete and self._keep_alive and not self.is_closed

    async def iter_body(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._is_paused and self._buffered < _HIGH_WATER // 2 and self.transport is not None:
                    self._is_paused = False
                    self.transport.resume_reading()
                yield chunk
                continue
            if self._is_complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_all(self) -> bytes:
        parts = [chunk async for chunk in self.iter_body()]
        return parts[0] if len(parts) == 1 else b"".join(parts)


class UpstreamClient:
    """Keep-alive connections per worker address (http only; https upstreams use httpx)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._addresses: dict[str, tuple[str, int, bytes, str]] = {}

    def _address(self, base_url: str) -> tuple[str, int, bytes, str]:
        """(host, port, Host header, path prefix) of a base URL such as http://h:p/prefix."""
        addr = self._addresses.get(base_url)
        if addr is None:
            u = urlsplit(base_url)
            host = u.hostname or "127.0.0.1"
            port = u.port or 80
            addr = (host, port, f"{host}:{port}".encode(), u.path.rstrip("/"))
            self._addresses[base_url] = addr
        return addr

    async def _connection(self, host: str, port: int) -> _Conn:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.is_closed and not conn.is_dropped():
                conn.is_reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Conn, host, port)
        except OSError as e:
            raise UpstreamError(f"cannot connect to {host}:{port}: {e}", never_sent=True) from None
        return conn

    async def request(self, base_url: str, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> _Conn:
        """Send a request and return the connection with the response headers read.

        The caller must pass the connection back to `release()` (always, even after an error).
        """
        host, port, host_header, prefix = self._address(base_url)
        conn = await self._connection(host, port)
        lines = [
            f"{method} {prefix}{target} HTTP/1.1\r\n".encode(),
            b"host: ",
            host_header,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for k, v in headers:
            lines += [k, b": ", v, b"\r\n"]
        lines.append(b"\r\n")
        try:
            await conn.exchange(b"".join(lines), body)
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, base_url: str, conn: _Conn) -> None:
        if not conn.should_keep_alive():
            conn.close()
            return
        host, port, _, _ = self._address(base_url)
        idle = self._idle.setdefault((host, port), deque())
        if len(idle) >= _MAX_IDLE_PER_ADDRESS:
            conn.close()
            return
        conn.is_reused = False
        idle.append(conn)

    def forget(self, base_url: str) -> None:
        """Drop idle connections to a worker that is gone."""
        host, port, _, _ = self._address(base_url)
        for conn in self._idle.pop((host, port), ()):
            conn.close()
        self._addresses.pop(base_url, None)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
