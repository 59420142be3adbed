"""uvicorn's HTTP/1.1 protocol with a header deadline and a cap on open connections (the API and the gateway).

uvicorn has neither: a connection that trickles a header line one byte at a time, or sends nothing, is held for
as long as the client likes (its keep-alive timer runs only after a response; `limit_concurrency` answers 503
to a new *request*, so sockets that never finish their headers pass it). 5,000 such sockets stayed open on the
gateway for as long as they were watched. `front_protocol(...)` makes a protocol class for `uvicorn.Config(http=...)`:

- `header_timeout_s`: a connection must finish its request headers within this many seconds of opening, and
  each later request on it within this many seconds of its first byte, else it is closed. The timer is armed
  when a connection opens and when a request's headers are still incomplete after the data at hand, so a
  keep-alive request that arrives whole (the usual case) costs two attribute writes, no timer;
- `max_connections`: a connection that would be one more than this is answered 503 (in the service's error
  shape) and closed at once, before any parser work; it is never added to uvicorn's connection set.

Both count in `switchyard_http_connections_dropped_total{reason}`. Plain subclass of uvicorn's httptools
protocol (a hard dependency), so every other behaviour is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any, ClassVar

from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

DROPPED = Counter(
    "switchyard_http_connections_dropped_total",
    "Inbound connections closed by the HTTP front: over the connection cap, or headers not received in time.",
    ["reason"],
)


def refusal_bytes(body: dict[str, Any]) -> bytes:
    """A whole 503 response, made once per server: the refused connection gets it written and is closed."""
    payload = json.dumps(body).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + payload


class HeadWithBody:
    """One response's transport: its first write (uvicorn's status line and headers) is held and goes out with
    the next one (the body's first chunk), in one write, or on the loop's next turn if none comes sooner.

    uvicorn writes a response's head and each body message separately: two sends, two segments with
    `TCP_NODELAY`, and the client woken twice, the first time for a head it cannot use yet. On a loaded host the
    woken client can take the CPU between the two writes; holding the head put a cold stream's first chunk
    ~0.2 ms sooner here (`bench/bench_gateway.py`). An interim `100 Continue` (uvicorn's, when the app first reads
    the body of an `Expect: 100-continue` request) is such a first write: it goes out on the next turn, the real
    head then unheld. Everything else is the connection's own transport.
    """

    __slots__ = ("_held", "_loop", "_started", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None
        self._started = False

    def write(self, data: bytes) -> None:
        if not self._started:
            self._started = True
            self._held = data
            self._loop.call_soon(self._release)
            return
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        self._transport.write(data)

    def _release(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self._release()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class FrontProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the two guards; `front_protocol` sets the class attributes."""

    header_timeout_s: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 1024
    refusal: ClassVar[bytes] = refusal_bytes({"detail": "too many connections"})

    # Per-connection state, as class defaults so no __init__ override is needed.
    _header_timer: asyncio.TimerHandle | None = None
    _in_headers: bool = False
    _refused: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            self.transport = transport  # uvicorn's connection_lost closes it again (a no-op)
            DROPPED.labels("cap").inc()
            transport.write(self.refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A request began in this data and its headers are not all here: they must be within the deadline.
        if self._in_headers and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.cycle is not None:  # a new request: its response's head waits for its body
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        DROPPED.labels("header_timeout").inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The next request's headers trickle in behind a response still going out: let that response finish,
            # then close (uvicorn closes a connection that is not kept alive once its response is sent).
            cycle.keep_alive = False
            return
        self.transport.close()


def front_protocol(header_timeout_s: float, max_connections: int, refusal: dict[str, Any]) -> type[FrontProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits; `refusal` is the 503's JSON body."""
    _warn_if_over_fd_limit(max_connections)
    attributes = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "refusal": refusal_bytes(refusal),
    }
    return type("FrontProtocol", (FrontProtocol,), attributes)


def _warn_if_over_fd_limit(max_connections: int) -> None:
    """Past the process's file limit accept() fails (asyncio then stops accepting for a second) before the cap can
    answer: say so at start rather than under load."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + 64 > soft:
        log.warning(
            "the HTTP connection cap (%d) is near or above this process's open-file limit (%d): raise `ulimit -n` "
            "or lower the cap",
            max_connections,
            soft,
        )
