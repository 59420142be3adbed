"""HTTP/1.1 to the engines: keep-alive connections per engine, httptools' response parser, one write per request.

Why not aiohttp, which the engine hops used before: its client ran ~0.35–0.45 ms of Python per call before the
request's last byte left, in a gateway woken cold by each request (aiohttp's own trace hooks, inside the gateway,
under `bench/bench_gateway.py`), the largest single part of the in-process gateway's added TTFT. An engine hop
needs little of what that buys (cookies, redirects, proxies, content decoding, multipart): a POST or a GET with
a few headers to a known host, its answer's status and content type, and the body as it comes. This does only
that, on the same C parser uvicorn uses for the other side (`httptools`, a direct dependency), and sends each
request, head and body, in one write.

- A connection carries one request at a time; an answer read to its end on a connection the engine keeps alive
  goes back to its engine's pool (`Response.release`; `Response.read` reads an answer whole and releases it),
  anything else is closed (`Response.close`: how a request is aborted, since vLLM aborts a request whose
  connection closes).
- Idle connections are reused newest first, dropped after `idle_s` (below the 5 s keep-alive uvicorn and vLLM
  default to) and at once when the engine closes them. A request on a pooled connection that closes before any
  byte of an answer (the engine's keep-alive ran out as it was sent: it never read the request) is sent again
  on a new connection, once.
- `max_connections` bounds the connections in use at once (a request waits for one to free up).
- Every failure is an `EngineHttpError` with a short `reason`: "connect" (refused, unreachable), "timeout" (the
  connect, the answer's head, or a read outlived its deadline), "closed" (the engine closed the connection or
  sent what is not HTTP), and three for an answer no honest engine sends (issue 37), each closing the
  connection at once: "head_too_large" (its status line and headers pass `max_head_bytes`), "head_timeout"
  (its head, once begun, has not ended `head_timeout_s` later) and "too_large" (an answer read whole, by
  `Response.read`, declares or sends more than its `max_bytes`).
- Bodies are buffered per connection up to `HIGH_WATER` bytes ahead of the reader; past that the socket stops
  being read until the reader catches up (a slow client does not make the gateway hold a whole stream). A body
  piece is at most what one socket read returns (asyncio reads 256 KiB at most), so neither a stream relayed
  chunk by chunk nor one of its chunks can grow without bound.
- A head is fed to the parser only up to `max_head_bytes`: httptools grows a header's name or value by
  concatenating each piece (quadratic, with no limit of its own), so a never-ending header is cut where it
  passes the bound, never parsed further. The head deadline runs from the head's first byte, not from the
  request: vLLM sends a non-streaming answer's head only once the whole answer is ready, which may honestly take
  up to `first_byte_timeout_s`, but it writes the head in one go; one that trickles on is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping

import httptools
from yarl import URL

__all__ = ["EngineHttp", "EngineHttpError", "Response"]

#: Bytes of an answer's body read ahead of its reader before the socket is paused, and resumed below.
HIGH_WATER, LOW_WATER = 256 * 1024, 64 * 1024
#: Defaults of the head's bounds (the gateway passes its settings, `max_answer_head_bytes` and `head_timeout_s`).
MAX_HEAD_BYTES, HEAD_TIMEOUT_S = 64 * 1024, 10.0


class EngineHttpError(Exception):
    """A call that failed; `reason` is "connect", "timeout", "closed", "head_too_large", "head_timeout" or
    "too_large" (see the module docstring)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _Connection(asyncio.Protocol):
    """One connection to an engine and the answer being read on it (httptools calls the `on_*` methods)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        key: tuple[str, int, bool],
        max_head_bytes: int = MAX_HEAD_BYTES,
        head_timeout_s: float = HEAD_TIMEOUT_S,
    ) -> None:
        self.loop, self.key = loop, key
        self.max_head_bytes, self.head_timeout_s = max_head_bytes, head_timeout_s
        self.head_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self.idle_in: list[_Connection] | None = None  # the pool's list holding it while idle
        self.begin()

    def begin(self) -> None:
        """Ready for the next answer on this connection."""
        self.status = 0
        self.content_type = ""
        self.content_length: int | None = None  # as the head declares it
        self.heard = False  # any byte of this answer
        self.head_bytes = 0  # of this answer's head, fed to the parser so far
        self._stop_head_timer()
        self.headed = self.complete = self.keep_alive = self.paused = False
        self.failure: EngineHttpError | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.heard = True
        try:
            if not self.headed:
                data = self._feed_head(data)
            if data:
                self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(EngineHttpError("closed", f"the engine's answer is not HTTP/1.1: {exc}"))
            self.close()

    def _feed_head(self, data: bytes) -> bytes:
        """Feed the head, at most `max_head_bytes` of it in all; what follows its end (body) is returned to be fed.
        Past the bound the answer fails and the connection closes, nothing more parsed. The head's first byte
        starts its deadline."""
        if self.head_bytes == 0 and self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)
        room = self.max_head_bytes - self.head_bytes
        piece = data if len(data) <= room else data[:room]
        self.head_bytes += len(piece)
        self.parser.feed_data(piece)
        if self.headed:
            return data[len(piece) :]
        if self.head_bytes >= self.max_head_bytes:
            detail = f"the engine's answer head passed {self.max_head_bytes} bytes"
            self.fail(EngineHttpError("head_too_large", detail))
            self.close()
        return b""

    def _head_late(self) -> None:
        self.head_timer = None
        if not self.headed:
            self.fail(EngineHttpError("head_timeout", f"the answer's head did not end {self.head_timeout_s:g} s on"))
            self.close()

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_head_timer()
        if self.idle_in is not None:  # closed by the engine while pooled: out of the pool at once
            with contextlib.suppress(ValueError):
                self.idle_in.remove(self)
            self.idle_in = None
        if not self.complete:
            self.fail(EngineHttpError("closed", f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"content-length" and value.strip().isdigit():  # else httptools refuses the answer
            self.content_length = int(value)

    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # --- the reader's side ---

    def fail(self, failure: EngineHttpError) -> None:
        if self.failure is None:
            self.failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _timed_out(self, what: str) -> None:
        self.fail(EngineHttpError("timeout", f"no {what} from the engine in time"))

    async def wait(self, deadline: float | None, what: str) -> None:
        """Until the next thing happens on the connection, or `deadline` (loop time) passes: a timeout fails it."""
        self.waiter = self.loop.create_future()
        timer = None if deadline is None else self.loop.call_at(deadline, self._timed_out, what)
        try:
            await self.waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        self.lost = True
        self._stop_head_timer()
        if self.transport is not None:
            self.transport.close()


class Response:
    """An engine's answer whose head has arrived: `status`, `content_type`, and the body as it comes."""

    __slots__ = ("_client", "_connection", "_done", "content_type", "status")

    def __init__(self, client: EngineHttp, connection: _Connection) -> None:
        self._client, self._connection, self._done = client, connection, False
        self.status, self.content_type = connection.status, connection.content_type

    async def chunk(self, deadline: float | None) -> bytes:
        """The next piece of the body as it arrived (b"" once it has all been read)."""
        connection = self._connection
        while True:
            if connection.body:
                data = connection.body.popleft()
                connection.buffered -= len(data)
                if connection.paused and connection.buffered < LOW_WATER and connection.transport is not None:
                    connection.paused = False
                    connection.transport.resume_reading()
                return data
            if connection.complete:
                return b""
            if connection.failure is not None:
                raise connection.failure
            await connection.wait(deadline, "body")

    async def chunks(self, read_timeout_s: float) -> AsyncIterator[bytes]:
        """The body's pieces, each within `read_timeout_s` of the one before."""
        loop = self._connection.loop
        while data := await self.chunk(loop.time() + read_timeout_s):
            yield data

    async def read(self, deadline: float | None, max_bytes: int | None = None) -> bytes:
        """The whole body (by `deadline`, loop time), and done with the answer: released, or closed when reading
        failed or was cancelled. An answer that declares, or sends, more than `max_bytes` fails ("too_large") as
        soon as it does: what is held is then at most `max_bytes` plus the read-ahead (`HIGH_WATER` and one
        socket read), and twice `max_bytes` while the pieces are joined (one piece, the usual case, is not)."""
        declared = self._connection.content_length
        parts: list[bytes] = []
        size = 0
        try:
            if max_bytes is not None and declared is not None and declared > max_bytes:
                raise EngineHttpError("too_large", f"the answer declares {declared} bytes, over {max_bytes}")
            while data := await self.chunk(deadline):
                size += len(data)
                if max_bytes is not None and size > max_bytes:
                    raise EngineHttpError("too_large", f"the answer passed {max_bytes} bytes")
                parts.append(data)
        except BaseException:
            self.close()
            raise
        self.release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read to its end and the
        engine keeps it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        connection = self._connection
        if connection.complete and connection.keep_alive and not connection.lost and not connection.body:
            self._client._put_back(connection)
        else:
            connection.close()
            self._client._freed()

    def close(self) -> None:
        """Close the connection whatever was read (the engine sees the client go and aborts the request)."""
        if self._done:
            return
        self._done = True
        self._connection.close()
        self._client._freed()


class EngineHttp:
    """The pooled client. Create inside the running event loop."""

    def __init__(
        self,
        connect_timeout_s: float,
        max_connections: int,
        idle_s: float = 4.0,
        max_head_bytes: int = MAX_HEAD_BYTES,
        head_timeout_s: float = HEAD_TIMEOUT_S,
    ) -> None:
        self.connect_timeout_s, self.idle_s = connect_timeout_s, idle_s
        self.max_head_bytes, self.head_timeout_s = max_head_bytes, head_timeout_s
        self.loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self, url: URL, method: str, headers: Mapping[str, str], body: bytes, deadline: float | None
    ) -> Response:
        """Send one request and wait for its answer's head, by `deadline` (loop time; None: no bound). A task
        cancelled meanwhile closes the connection (so the engine aborts the request)."""
        request = _encode(method, url, headers, body)
        await self._slots.acquire()
        connection = None
        try:
            connection = self._pooled(url)
            if connection is not None and not await self._answered(connection, request, deadline):
                connection.close()  # closed by the engine while idle (its keep-alive ran out): send it afresh
                connection = None
            if connection is None:
                connection = await self._connect(url, deadline)
                if not await self._answered(connection, request, deadline):
                    raise connection.failure  # type: ignore[misc]
        except BaseException:
            if connection is not None:
                connection.close()
            self._slots.release()
            raise
        return Response(self, connection)

    @staticmethod
    async def _answered(connection: _Connection, request: bytes, deadline: float | None) -> bool:
        """Send `request` and wait for the answer's head: True once it is here; False when the connection closed
        before any byte of an answer came back (a pooled one the engine closed meanwhile, which has not read the
        request: it may be sent again on a new connection); any other failure raises."""
        connection.begin()
        connection.transport.write(request)  # type: ignore[union-attr]
        while not connection.headed:
            failure = connection.failure
            if failure is not None:
                if failure.reason == "closed" and connection.lost and not connection.heard:
                    return False
                raise failure
            await connection.wait(deadline, "answer")
        return True

    def _pooled(self, url: URL) -> _Connection | None:
        idle = self._idle.get(_key(url))
        if not idle:
            return None
        oldest_kept = self.loop.time() - self.idle_s
        while idle:
            connection = idle.pop()  # the newest first
            connection.idle_in = None
            if not connection.lost and connection.idle_since >= oldest_kept:
                return connection
            connection.close()
        return None

    async def _connect(self, url: URL, deadline: float | None) -> _Connection:
        host, port, tls = _key(url)
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        timeout = self.connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - self.loop.time()))
        try:
            async with asyncio.timeout(timeout):
                _, connection = await self.loop.create_connection(
                    lambda: _Connection(self.loop, (host, port, tls), self.max_head_bytes, self.head_timeout_s),
                    host,
                    port,
                    ssl=self._tls if tls else None,
                )
        except TimeoutError:
            raise EngineHttpError("timeout", f"no connection to {host}:{port} within {timeout:g} s") from None
        except OSError as exc:
            raise EngineHttpError("connect", f"cannot connect to {host}:{port}: {exc}") from None
        return connection

    def _put_back(self, connection: _Connection) -> None:
        self._slots.release()
        if self._closed:
            connection.close()
            return
        connection.idle_since = self.loop.time()
        idle = self._idle.setdefault(connection.key, [])
        idle.append(connection)
        connection.idle_in = idle

    def _freed(self) -> None:
        self._slots.release()

    async def close(self) -> None:
        """Close every idle connection; answers still being read close theirs when released."""
        self._closed = True
        for idle in self._idle.values():
            for connection in list(idle):
                connection.idle_in = None
                connection.close()
        self._idle.clear()


def _key(url: URL) -> tuple[str, int, bool]:
    return url.raw_host or "", url.port or (443 if url.scheme == "https" else 80), url.scheme == "https"


def _encode(method: str, url: URL, headers: Mapping[str, str], body: bytes) -> bytes:
    """The request's head and body as one buffer; a header value with a line break is refused (it would end the
    head early: header injection)."""
    lines = [f"{method} {url.raw_path_qs} HTTP/1.1\r\nhost: {url.raw_authority}\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"content-length: {len(body)}\r\n\r\n")
    return "".join(lines).encode("latin-1") + body
