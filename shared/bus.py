"""The one way Switchyard processes talk to NATS.

`Bus` wraps a nats-py connection with what every service needs and none should rewrite:

- connect with authentication/TLS from settings, retrying the first connection with capped exponential
  backoff (a service may start before NATS) and reconnecting forever afterwards;
- idempotent JetStream stream and KV bucket setup (safe to call from every replica on every start);
- typed publish / subscribe / request / serve over the msgpack codec, where a payload that fails to decode
  is counted by reason and answered with an `ErrorReply` (request/reply) or dropped (pub/sub), and a
  handler that raises is counted and logged, so one bad message never takes a service down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from switchyard.shared.codec import ErrorReply, WireModel, decode, decode_reply, encode
from switchyard.shared.errors import ConfigError, Impersonation, Relayed, ReplicaImpersonation, WireError
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.stream_limits import LIMIT_FIELDS, bucket_limits, contract_limits, limits_differ
from switchyard.shared.subjects import Durable, Subjects

if TYPE_CHECKING:
    from switchyard.shared.tracing import Tracing

log = logging.getLogger(__name__)

M = TypeVar("M", bound=WireModel)
R = TypeVar("R", bound=WireModel)
T = TypeVar("T")

REJECTED = Counter(
    "switchyard_bus_rejected_total",
    "Messages refused because they failed to decode, by subscription and reason code.",
    ["subscription", "code"],
)
HANDLER_ERRORS = Counter(
    "switchyard_bus_handler_errors_total",
    "Messages whose handler raised; the service kept running.",
    ["subscription"],
)


def check_sender(subjects: Subjects, subject: str, message: WireModel) -> None:
    """Refuse a message on `<prefix>.engine.<id>.` whose `engine_id` is not `<id>` (raises `Impersonation`).

    The bus permissions let engine X publish only under its own subject, so the subject says who sent it. The
    same holds for a replica's decisions on `<prefix>.route.decided.<kind>.<id>` (`replica_id` must be `<id>`).
    """
    sender = subjects.engine_of(subject)
    claimed = getattr(message, "engine_id", None)
    if sender is not None and claimed is not None and claimed != sender:
        raise Impersonation("engine_id", f"{claimed!r} published on {sender!r}'s subject")
    replica = getattr(message, "replica_id", None)  # only decisions carry one: other messages split no subject
    if replica is not None and (decider := subjects.decider_of(subject)) is not None and replica != decider:
        raise ReplicaImpersonation("replica_id", f"decisions of {replica!r} published on {decider!r}'s subject")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a last `>` one or more."""
    if pattern == subject:
        return True
    wanted, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(wanted) == len(got)


def _relayed(pattern: str, msg: Msg) -> bool:
    """Whether a core subscription on `pattern` got a message published elsewhere: a JetStream push consumer's
    delivery, which keeps the stored message's subject. Whoever may create a consumer picks its deliver
    subject (nats-server checks no permission on it), so stored bytes could arrive on any subscription; an
    engine's stored bytes relayed onto `<p>.engine.e1.hello` would be a hello in e1's name."""
    return msg.subject != pattern and not subject_matches(pattern, msg.subject)


def _same_durable(current: ConsumerConfig, wanted: ConsumerConfig) -> bool:
    """Whether a durable's settings are the code's (what the server fills in by default is not compared)."""
    return (
        current.filter_subject == wanted.filter_subject
        and not current.filter_subjects
        and current.ack_policy == wanted.ack_policy
        and current.ack_wait == wanted.ack_wait
        and current.max_deliver == wanted.max_deliver
        and current.deliver_subject is None
    )


def rejected_count(subscription: str, code: str) -> float:
    """Current value of the rejection counter (for tests and status pages)."""
    return REJECTED.labels(subscription, code)._value.get()


def _tls_context(settings: SwitchyardSettings) -> ssl.SSLContext | None:
    if not (settings.nats_tls_ca or settings.nats_tls_cert):
        return None
    context = ssl.create_default_context(cafile=str(settings.nats_tls_ca) if settings.nats_tls_ca else None)
    if settings.nats_tls_cert and settings.nats_tls_key:
        context.load_cert_chain(str(settings.nats_tls_cert), str(settings.nats_tls_key))
    return context


def role_user(settings: SwitchyardSettings, role: str | None) -> tuple[str, str] | None:
    """(user, password) of `role` from the per-role credentials file, if settings name one."""
    if role is None or settings.nats_credentials is None:
        return None
    from switchyard.shared.nats_auth import Credentials

    users = Credentials.load(settings.nats_credentials).users
    if role not in users:
        raise ConfigError(f"no NATS credentials for role {role!r} in {settings.nats_credentials}")
    return users[role]["user"], users[role]["password"]


def connect_options(settings: SwitchyardSettings, servers: list[str], role: str | None = None) -> dict[str, Any]:
    """nats-py connect() keyword arguments for these settings (as `role`, when per-role credentials are set).

    A connection with a user name takes replies on its own inbox prefix (`_INBOX_<user>.`), which is all the
    generated server configuration lets it subscribe to (see `shared.nats_auth`).
    """
    options: dict[str, Any] = {
        "servers": servers,
        "connect_timeout": settings.nats_connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1,
        "tls": _tls_context(settings),
    }
    user = role_user(settings, role)
    if user is not None:
        options["user"], options["password"] = user
    elif settings.nats_user is not None:
        options["user"], options["password"] = settings.nats_user, settings.nats_password
    if "user" in options:
        from switchyard.shared.nats_auth import inbox_prefix

        with contextlib.suppress(ValueError):  # a user name that is no subject token keeps the default inbox
            options["inbox_prefix"] = inbox_prefix(options["user"])
    if user is not None:
        return {k: v for k, v in options.items() if v is not None}
    if settings.nats_token is not None:
        options["token"] = settings.nats_token
    if settings.nats_nkey_seed_file is not None:
        options["nkeys_seed"] = str(settings.nats_nkey_seed_file)
    if settings.nats_creds_file is not None:
        options["user_credentials"] = str(settings.nats_creds_file)
    return {k: v for k, v in options.items() if v is not None}


class _RateLimitedWarning:
    """Log rejected messages at most once per `interval_s` per subscription: a peer sending garbage at line
    rate must not turn the log into the bottleneck (the counter still counts every one)."""

    def __init__(self, label: str, interval_s: float = 1.0) -> None:
        self.label, self.interval_s = label, interval_s
        self.next_at = 0.0
        self.suppressed = 0
        self.next_failure_at = 0.0
        self.failures_suppressed = 0

    def __call__(self, exc: WireError) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last warning)" if self.suppressed else ""
        log.warning("rejected message on %s: %s%s", self.label, exc, more)
        self.next_at, self.suppressed = now + self.interval_s, 0

    def failed(self, what: str) -> None:
        """Log the exception being handled (with its traceback) at most once per interval, with a count of the
        failures held back since: a handler failing on every message must not flood the log."""
        now = time.monotonic()
        if now < self.next_failure_at:
            self.failures_suppressed += 1
            return
        more = f" ({self.failures_suppressed} more since the last one)" if self.failures_suppressed else ""
        log.exception("%s for %s failed%s", what, self.label, more)
        self.next_failure_at, self.failures_suppressed = now + self.interval_s, 0


def _quiet_callbacks(
    name: str, closing: list[bool], on_reconnect: list[Callable[[], None]] | None = None
) -> dict[str, Any]:
    """One log line per connection event instead of nats-py's default tracebacks.

    `closing[0]` is set when we close the connection ourselves: neither the disconnect nor an error on the way
    (nats-py reports "connection closed" to whatever still uses it) is worth a warning then. Each of
    `on_reconnect` is called after a reconnect.
    """

    async def on_error(exc: Exception) -> None:
        if closing[0]:  # e.g. an ordered consumer's heartbeat meeting the closed connection while we drain it
            log.debug("%s: NATS error while closing: %s", name, exc)
            return
        log.warning("%s: NATS error: %s", name, exc)

    async def on_disconnected() -> None:
        if not closing[0]:
            log.warning("%s: disconnected from NATS, reconnecting", name)

    async def on_reconnected() -> None:
        log.info("%s: reconnected to NATS", name)
        for hook in on_reconnect or ():
            hook()

    return {"error_cb": on_error, "disconnected_cb": on_disconnected, "reconnected_cb": on_reconnected}


#: JetStream's answer when a stream's `max_bytes` does not fit in what the server may still reserve.
_INSUFFICIENT_STORAGE = 10047
#: JetStream's answers to a replica count the server cannot give: a single server (not clustered), and a cluster
#: with fewer JetStream peers up than replicas asked for.
_REPLICAS_NOT_CLUSTERED = 10074
_NO_PEERS = 10005


async def _reserving(stream: str, call: Awaitable[T], replicas: int = 1) -> T:
    """Run a stream create/update; a refusal to reserve its `max_bytes`, or to keep `replicas` copies, becomes a
    `ConfigError` saying what to do."""
    try:
        return await call
    except APIError as exc:
        if exc.err_code in (_REPLICAS_NOT_CLUSTERED, _NO_PEERS) and replicas > 1:
            raise ConfigError(
                f"NATS cannot keep {replicas} replicas of stream {stream} ({exc.description}): "
                "SWITCHYARD_STREAM_REPLICAS above 1 needs a JetStream cluster with at least that many nodes up; "
                "set it to 1 for a single server (docs/deploy.md)"
            ) from exc
        if exc.err_code != _INSUFFICIENT_STORAGE:
            raise
        raise ConfigError(
            f"NATS cannot reserve the bytes of stream {stream}: JetStream reserves every stream's max_bytes "
            "up front. Raise the server's jetstream max_file_store (`switchyard nats-config` writes one that "
            "holds the contract's streams) or lower the SWITCHYARD_STREAM_*_MAX_BYTES / SWITCHYARD_KV_*_MAX_BYTES "
            "settings (docs/security.md)"
        ) from exc


class Bus:
    """A connected NATS client plus JetStream, speaking the Switchyard wire contract."""

    def __init__(self, nc: NatsClient, settings: SwitchyardSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.subjects: Subjects = settings.subjects
        self.max_payload = settings.max_payload_bytes
        self._closing = [False]  # shared with the connection's callbacks: our own close is not an outage
        #: Reconnects so far, and futures resolved at the next one (`next_reconnect`).
        self.reconnects = 0
        self._reconnect_waiters: set[asyncio.Future[None]] = set()

    def _on_reconnected(self) -> None:
        self.reconnects += 1
        for waiter in self._reconnect_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._reconnect_waiters.clear()

    def next_reconnect(self) -> asyncio.Future[None]:
        """A future resolved when the connection next comes back after a drop: a request in flight then has
        lost its reply (replies are core NATS) and can be resent at once instead of waiting out its timeout."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reconnect_waiters.add(waiter)
        return waiter

    @classmethod
    async def connect(
        cls,
        settings: SwitchyardSettings,
        name: str = "switchyard",
        servers: list[str] | None = None,
        *,
        no_echo: bool = False,
        role: str | None = None,
    ) -> Bus:
        """Connect, retrying with capped exponential backoff for `nats_initial_connect_s` seconds.

        `no_echo`: the server does not deliver this connection's own publishes to its own subscriptions.
        `role`: connect as this role's user when settings name a per-role credentials file.
        """
        servers = servers or settings.nats_servers
        if not servers:
            raise ConfigError("no NATS server configured: set SWITCHYARD_NATS_SERVERS or pass --nats-url")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.nats_initial_connect_s
        delay = 0.1
        closing = [False]
        hooks: list[Callable[[], None]] = []
        options = {
            **connect_options(settings, servers, role),
            **_quiet_callbacks(name, closing, hooks),
            "no_echo": no_echo,
        }
        # nats-py's own loop never gives up on a first connection when attempts are unlimited, so probe with
        # one quick attempt per round and do the backing off here.
        probe_closing = [False]
        probe = {
            **options,
            **_quiet_callbacks(name, probe_closing),
            "allow_reconnect": False,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0,
        }
        while True:
            try:
                nc = await nats.connect(name=name, **probe)
                break
            except Exception as exc:
                if loop.time() + delay > deadline:
                    raise ConnectionError(f"cannot reach NATS at {', '.join(servers)}: {exc}") from exc
                log.warning("NATS not reachable yet (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)
        probe_closing[0] = True
        await nc.close()
        # Reconnect with the real options: from here on nats-py reconnects forever and buffers publishes.
        nc = await nats.connect(name=name, **options)
        bus = cls(nc, settings)
        bus._closing = closing
        hooks.append(bus._on_reconnected)
        return bus

    async def close(self) -> None:
        self._closing[0] = True
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # draining a connection that is already going away
                await self.nc.close()

    # ----- JetStream setup -----

    async def ensure_stream(self, name: str, subjects: list[str], **config: Any) -> str:
        """Create the stream, or update it if its subjects, limits or replica count differ: "created", "updated"
        or "unchanged".

        Idempotent, and safe under concurrent callers with the same settings (they make the same update); replicas
        with different settings would each impose theirs on start, so give every replica the same. The replica
        count is `SWITCHYARD_STREAM_REPLICAS`; a clustered server changes an existing stream's count in place
        (R1 -> R3 copies it to two more nodes), a single server refuses any count above 1 (a `ConfigError`).
        """
        replicas = self.settings.stream_replicas
        wanted = StreamConfig(
            name=name, subjects=subjects, storage=StorageType.FILE, max_msg_size=self.max_payload, num_replicas=replicas
        )
        for key, value in config.items():
            setattr(wanted, key, value)
        managed = {k: getattr(wanted, k) for k in {*LIMIT_FIELDS, *config}}
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            try:
                await _reserving(name, self.js.add_stream(wanted), replicas)
                return "created"
            except BadRequestError:  # another replica created it meanwhile
                info = await self.js.stream_info(name)
        current = info.config
        same_subjects = sorted(current.subjects or []) == sorted(subjects)
        if same_subjects and not limits_differ(current, managed) and (current.num_replicas or 1) == replicas:
            return "unchanged"
        if (current.num_replicas or 1) != replicas:
            log.info(
                "stream %s: %d replicas -> %d (SWITCHYARD_STREAM_REPLICAS)", name, current.num_replicas or 1, replicas
            )
        await _reserving(name, self.js.update_stream(wanted), replicas)
        return "updated"

    async def ensure_streams(self) -> dict[str, str]:
        """Every stream of the bus contract (see `Subjects.streams`), with its limits (`shared.stream_limits`);
        a stream created before it had them is updated. Returns what was done to each."""
        limits = contract_limits(self.settings)
        return {
            name: await self.ensure_stream(name, subjects, **limits[name].config())
            for name, subjects in self.subjects.streams().items()
        }

    async def ensure_durable(self, durable: Durable, *, ack_wait: float, max_deliver: int) -> bool:
        """Create the durable consumer, or set its settings back to the code's; True if it was missing or had
        other settings (another release's, or an operator's edit): its filter and pointer decide what the
        owning service ever sees, so whoever checks it periodically also repairs it."""
        wanted = ConsumerConfig(
            durable_name=durable.name,
            filter_subject=durable.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
        )
        try:
            current = (await self.js.consumer_info(durable.stream, durable.name)).config
        except NotFoundError:
            current = None
        if current is not None and _same_durable(current, wanted):
            return False
        await self.js.add_consumer(durable.stream, config=wanted)  # create-or-update on NATS >= 2.9
        return True

    async def durable_pull(
        self, durable: Durable, *, ack_wait: float, max_deliver: int
    ) -> JetStreamContext.PullSubscription:
        """A pull subscription on a durable consumer whose settings follow the code: created, or updated when
        a consumer of that name already exists with other settings (`pull_subscribe` would silently keep the
        old ones)."""
        await self.ensure_durable(durable, ack_wait=ack_wait, max_deliver=max_deliver)
        return await self.js.pull_subscribe_bind(durable.name, durable.stream)

    async def ensure_kv(self, bucket: str, history: int = 16, ttl: float | None = None) -> KeyValue:
        """Open a KV bucket, creating it on first use (`ttl`: entries expire this long after their last write).

        A contract bucket gets its byte bounds (`stream_limits.bucket_limits`), also when it exists without them.
        Every bucket gets `SWITCHYARD_STREAM_REPLICAS` copies, also one created with another count (as
        `ensure_stream`). History and TTL stay as the bucket was created: two services may ask with different TTLs.
        """
        bounds = bucket_limits(self.settings).get(bucket)
        max_bytes, max_value = bounds or (-1, self.max_payload)
        replicas = self.settings.stream_replicas
        stream = f"KV_{bucket}"
        try:
            kv = await self.js.key_value(bucket)
        except BucketNotFoundError:
            try:
                return await _reserving(
                    stream,
                    self.js.create_key_value(
                        bucket=bucket,
                        history=history,
                        max_value_size=max_value,
                        ttl=ttl,
                        max_bytes=max_bytes,
                        replicas=replicas,
                    ),
                    replicas,
                )
            except BadRequestError:  # created concurrently with another config: use what exists
                kv = await self.js.key_value(bucket)
        current = (await self.js.stream_info(stream)).config
        wanted: dict[str, Any] = {}
        bytes_wanted = {"max_bytes": max_bytes, "max_msg_size": max_value}
        if bounds is not None and limits_differ(current, bytes_wanted):  # another bucket's bytes are left alone
            wanted |= bytes_wanted
        if (current.num_replicas or 1) != replicas:
            log.info(
                "bucket %s: %d replicas -> %d (SWITCHYARD_STREAM_REPLICAS)", bucket, current.num_replicas or 1, replicas
            )
            wanted["num_replicas"] = replicas
        if wanted:
            await _reserving(stream, self.js.update_stream(dataclasses.replace(current, **wanted)), replicas)
        return kv

    # ----- messaging -----

    async def publish(self, subject: str, message: WireModel) -> None:
        await self.nc.publish(subject, encode(message))

    async def js_publish(self, subject: str, message: WireModel, msg_id: str | None = None) -> int:
        """Publish to a stream and wait for the server's ack; `msg_id` de-duplicates retries."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        ack = await self.js.publish(subject, encode(message), headers=headers)
        return ack.seq

    async def request(self, subject: str, message: WireModel, reply: type[R], timeout: float = 1.0) -> R:  # noqa: ASYNC109
        """Send a request and decode the answer; raises `RemoteError` if the server replied with an error."""
        msg = await self.nc.request(subject, encode(message), timeout=timeout)
        return decode_reply(msg.data, reply, self.max_payload)

    def _decoder(self, schema: type[M], label: str) -> Callable[[bytes], M | WireError]:
        max_payload = min(self.max_payload, schema.MAX_WIRE_BYTES or self.max_payload)
        warn = _RateLimitedWarning(label)

        def _decode(data: bytes) -> M | WireError:
            try:
                return decode(data, schema, max_payload)
            except WireError as exc:
                REJECTED.labels(label, exc.code).inc()
                warn(exc)
                return exc

        return _decode

    async def subscribe(
        self,
        subject: str,
        schema: type[M],
        handler: Callable[[M, Msg], Awaitable[None] | None],
        queue: str = "",
        admit: Callable[[Msg], bool] | None = None,
    ) -> Subscription:
        """Deliver decoded messages to `handler`; malformed ones are counted and dropped. `admit`, if given, sees
        each message before it is decoded (a rate bound: a message it refuses costs no decoding)."""
        decode_one = self._decoder(schema, subject)
        is_async = inspect.iscoroutinefunction(handler)
        warn = _RateLimitedWarning(subject)

        async def _on_message(msg: Msg) -> None:
            if admit is not None and not admit(msg):
                return
            if _relayed(subject, msg):
                REJECTED.labels(subject, Relayed.code).inc()
                warn(Relayed("subject", f"a message stored on {msg.subject!r} relayed here; dropped"))
                return
            message = decode_one(msg.data)
            if isinstance(message, WireError):
                return
            try:
                check_sender(self.subjects, msg.subject, message)
            except (Impersonation, ReplicaImpersonation) as exc:
                REJECTED.labels(subject, exc.code).inc()
                warn(exc)
                return
            try:
                result = handler(message, msg)
                if is_async:
                    await result  # type: ignore[misc]
            except Exception:
                HANDLER_ERRORS.labels(subject).inc()
                warn.failed("handler")

        return await self.nc.subscribe(subject, queue=queue, cb=_on_message)

    async def serve(
        self,
        subject: str,
        schema: type[M],
        handler: Callable[[M], Awaitable[WireModel | bytes] | WireModel | bytes],
        queue: str = "",
        *,
        idle: Callable[[], None] | None = None,
        tracing: Tracing | None = None,
        span_name: str = "",
    ) -> Subscription:
        """Answer requests on `subject`. Every request gets exactly one reply: the handler's, or an ErrorReply.

        The handler returns a message, or one it has encoded already (bytes, sent as they are).

        `idle`, if given, is called after a reply when no further request is waiting on this subscription (the
        end of a burst), on the loop's next turn: after nats-py's flusher has written the reply, so nothing it
        does delays one. A failure in it is logged and counted, never fatal.

        `tracing`, if given (tracing on), wraps each request in a server span `span_name` (default: the subject),
        the child of the `traceparent` in the request's NATS headers when it has one, current while the handler
        runs (which may `annotate` it). None: no span, nothing read from the headers.
        """
        decode_one = self._decoder(schema, subject)
        is_async = inspect.iscoroutinefunction(handler)
        subscription: list[Subscription] = []  # bound once subscribed (a request may be handled before that)
        failures = _RateLimitedWarning(subject)
        loop = asyncio.get_running_loop()
        span_attributes = {"messaging.system": "nats", "messaging.destination.name": subject}

        async def _on_request(msg: Msg) -> None:
            if not msg.reply:
                REJECTED.labels(subject, "no_reply_subject").inc()
                return
            if _relayed(subject, msg):  # not a request at all: its reply subject would be an acknowledgement
                REJECTED.labels(subject, Relayed.code).inc()
                return
            span = token = error = None
            if tracing is not None:
                span, token = tracing.enter(span_name or subject, msg.headers, span_attributes)
            try:
                request = decode_one(msg.data)
                if isinstance(request, WireError):
                    error = request.code
                    payload = encode(ErrorReply.from_exception(request))
                else:
                    try:
                        result = handler(request)
                        answer = await result if is_async else result  # type: ignore[misc]
                        payload = answer if isinstance(answer, bytes) else encode(answer)  # type: ignore[arg-type]
                    except WireError as exc:  # the handler judged the request invalid (e.g. wrong signature shape)
                        REJECTED.labels(subject, exc.code).inc()
                        error = exc.code
                        payload = encode(ErrorReply.from_exception(exc))
                    except Exception as exc:
                        HANDLER_ERRORS.labels(subject).inc()
                        failures.failed("handler")
                        error = type(exc).__name__
                        payload = encode(ErrorReply.from_exception(exc))
            finally:
                if span is not None:
                    tracing.leave(span, token, error)  # type: ignore[union-attr]
            await msg.respond(payload)
            if idle is not None and (not subscription or subscription[0].pending_msgs == 0):
                loop.call_soon(run_idle)  # after the flusher's turn, which `respond` has just scheduled

        def run_idle() -> None:
            try:
                idle()  # type: ignore[misc]
            except Exception:
                HANDLER_ERRORS.labels(subject).inc()
                failures.failed("idle hook")

        subscription.append(await self.nc.subscribe(subject, queue=queue, cb=_on_request))
        return subscription[0]
