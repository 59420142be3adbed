"""What every Switchyard service does the same way: schema setup, signals, JetStream message decoding."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from nats.aio.msg import Msg
from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.js.errors import ServiceUnavailableError
from prometheus_client import start_http_server

from switchyard.shared.bus import REJECTED, check_sender
from switchyard.shared.codec import WireModel, decode
from switchyard.shared.errors import WireError
from switchyard.shared.subjects import Subjects

#: What a JetStream pull `fetch` raises when it is in flight while the NATS server restarts (JetStream answers
#: 503, or nobody does): transient, so a service's fetch loop waits a moment and fetches again. `make chaos`
#: found the migration service exiting on the first of these.
FETCH_WHILE_NATS_RECOVERS = (ServiceUnavailableError, NoRespondersError, ConnectionReconnectingError)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=WireModel)


_UPGRADE_LOCK = threading.Lock()


def _upgrade(database_url: str) -> None:
    # imported here: the router uses this module but no database, and restarts faster without SQLAlchemy
    from switchyard.shared.db.engine import upgrade

    with _UPGRADE_LOCK:  # Alembic's `context`/`op` are process globals: one upgrade at a time per process
        upgrade(database_url)


async def ensure_schema(database_url: str, attempts: int = 5, outage_s: float = 120.0) -> None:
    """Bring the schema to head; retried because services in other processes may race to create it.

    A database that cannot be reached (a connection error) is waited for, up to `outage_s`: a service
    (re)started during a database outage must not exit (`make chaos` saw the API give up 2 s into one)."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + outage_s
    attempt = 0
    while True:
        try:
            await asyncio.to_thread(_upgrade, database_url)
            return
        except Exception as exc:
            unreachable = isinstance(exc, (OperationalError, InterfaceError, OSError))
            attempt += 0 if unreachable else 1
            if attempt >= attempts or (unreachable and loop.time() > deadline):
                raise
            log.warning("schema upgrade failed (%s); retrying", exc)
            await asyncio.sleep(1.0 if unreachable else 0.2 * attempt)


class RateLimitedLog:
    """At most one warning per `interval_s` for one source of trouble, then a summary of how many were held back:
    hostile input at line rate must not turn the log into the bottleneck (logs grew 150 MB in minutes)."""

    def __init__(self, logger: logging.Logger, label: str, interval_s: float = 10.0) -> None:
        self.logger, self.label, self.interval_s = logger, label, interval_s
        self.next_at = 0.0
        self.suppressed = 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more {self.label} warnings held back)" if self.suppressed else ""
        self.logger.warning("%s%s", message, more)
        self.next_at, self.suppressed = now + self.interval_s, 0


_stream_warnings: dict[str, RateLimitedLog] = {}


async def decode_stream_message(
    msg: Msg, schema: type[M], label: str, max_payload: int, *, acked: bool = True, subjects: Subjects | None = None
) -> M | None:
    """Decode a JetStream message; a malformed one is counted, logged and (if `acked`) terminated, never redelivered.

    With `subjects`, a message on an engine's subject that names another engine is refused (`check_sender`)."""
    try:
        message = decode(msg.data, schema, max_payload)
        if subjects is not None:
            check_sender(subjects, msg.subject, message)
        return message
    except WireError as exc:
        REJECTED.labels(label, exc.code).inc()
        _stream_warnings.setdefault(label, RateLimitedLog(log, "rejected-message", 1.0))(
            f"rejected message on {label}: {exc}"
        )
        if acked:
            await msg.term()
        return None


@contextlib.contextmanager
def metrics_endpoint(port: int | None, host: str = "127.0.0.1") -> Iterator[None]:
    """Serve this process's Prometheus metrics on `host:port` while the block runs (None: not at all)."""
    if port is None:
        yield
        return
    server, _thread = start_http_server(port, host)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


async def supervised(name: str, loop_body: Callable[[], Awaitable[None]], max_backoff_s: float = 30.0) -> None:
    """Run a service's background loop forever: if it raises, log it and start it again after a backoff.

    A background loop (watching a KV key, housekeeping) that dies silently leaves a service that answers
    but no longer follows the fleet; restarting it is always better than either that or crashing.
    """
    backoff = 0.5
    while True:
        try:
            await loop_body()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting it in %.1f s", name, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until SIGINT/SIGTERM sets `stop` (the CLI entry point of every service)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    asyncio.run(runner())
