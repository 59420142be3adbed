"""What keeps a `RouterCore` current from the bus, wherever the core runs: in `switchyard router`, or inside
each gateway (`services.gateway.local_route`).

`CoreFeed` gives the core every engine's hello and telemetry (asking an engine it has no hello from to
announce itself), KV-cache events when a profile reads the precise prefix index, the other replicas' decisions
(`sy.route.decided.>`), the routing artifact and a housekeeping tick; `DecisionSharer` publishes the core's own
decisions under the replica's own subject (`Subjects.decided`). The router watches the artifact's KV key (a
consumer); a gateway reads it one message at a time every `artifact_poll_s` (`ArtifactPoller`): its
credentials may create no consumer, which could relay the stored artifact onto a subject of its choosing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from switchyard.services.artifacts import ArtifactError, last_valid_artifact, load_artifact
from switchyard.services.router import metrics
from switchyard.services.router.ask import LOCAL_REPORTER
from switchyard.services.router.core import Decided, RouterCore
from switchyard.services.runtime import supervised
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode_unchecked
from switchyard.shared.schemas import (
    MAX_SHARED_DECISIONS,
    Announce,
    Hello,
    KvEvents,
    RouteDecisions,
    RoutingArtifact,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 1.0
ANNOUNCE_INTERVAL_S = 1.0


class DecisionSharer:
    """Collects this replica's decisions and publishes them as `RouteDecisions` on `subject`.

    `idle` runs at the end of each burst of requests (`Bus.serve`'s hook, called once nats-py's flusher has
    written the burst's replies; a gateway calls it after each decision). It never publishes there: it
    schedules the batch for the loop's next turn, so sharing adds nothing to a route round trip (encoding a
    batch before the replies were written held every reply of the burst back by that much). It does so unless
    the previous batch left less than `interval_s` ago; what such bursts leave waits for the next burst end
    past the interval, or, if traffic pauses, for a timer one interval later. So decisions are shared after
    their replies, at most one message per `interval_s`, and none waits more than twice that.
    """

    def __init__(self, bus: Bus, replica_id: str, interval_s: float, subject: str) -> None:
        self.bus, self.replica_id, self.interval_s, self.subject = bus, replica_id, interval_s, subject
        self.pending: list[Decided] = []
        self.batches = 0
        self._loop = asyncio.get_running_loop()
        self._last = -math.inf  # loop time of the last publication
        self._timer: asyncio.Handle | None = None  # the scheduled publication, if any
        self._soon = False  # ... scheduled for the loop's next turn (not an interval later)
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, decided: Decided) -> None:
        self.pending.append(decided)

    def idle(self) -> None:
        if not self.pending:
            return
        due = self._last + self.interval_s
        if self._loop.time() >= due:
            if self._timer is not None and not self._soon:  # a later publication: bring it forward
                self._timer.cancel()
                self._timer = None
            if self._timer is None:
                self._timer, self._soon = self._loop.call_soon(self._on_timer), True  # after the flusher's turn
        elif self._timer is None:
            self._timer = self._loop.call_at(due + self.interval_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._soon = None, False
        if self.pending:
            task = self._loop.create_task(self.flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Publish everything pending now (values validated on their way in: no re-validation)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._soon = None, False
        self._last = self._loop.time()
        pending, self.pending = self.pending, []
        for start in range(0, len(pending), MAX_SHARED_DECISIONS):
            kinds, request_ids, engine_ids, tokens, sessions = zip(
                *pending[start : start + MAX_SHARED_DECISIONS], strict=True
            )
            columns = {"kinds": kinds, "request_ids": request_ids, "engine_ids": engine_ids, "prompt_tokens": tokens}
            if any(sessions):  # the column only when a decision names a session (a router's never do)
                columns["sessions"] = sessions
            payload = encode_unchecked(RouteDecisions, {"replica_id": self.replica_id, **columns})
            await self.bus.nc.publish(self.subject, payload)
            self.batches += 1

    async def close(self) -> None:
        """Publish what is pending and stop the timer (the replica is going away)."""
        await self.flush()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def last_valid_by_get(
    kv: KeyValue, key_name: str, max_bytes: int, signing_key: bytes | None, newest: int, depth: int
) -> tuple[RoutingArtifact, int] | None:
    """The newest valid artifact among the `depth` revisions before `newest`, read one message at a time (no
    consumer): what `last_valid_artifact` finds from the key's history, for a reader that may create none."""
    for revision in range(newest - 1, max(0, newest - 1 - depth), -1):
        try:
            entry = await kv.get(key_name, revision=revision)
        except (KeyNotFoundError, NotFoundError):
            continue  # another key's revision, or gone from the bucket
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None  # removed on purpose: nothing older is current
        try:
            return load_artifact(entry.value, max_bytes, "KV artifact", signing_key), revision
        except ArtifactError:
            continue
    return None


class CoreFeed:
    """Feeds one `RouterCore` from the bus (see the module's docstring). `engines=False`: the owner already
    subscribes to hellos, telemetry and KV events for its own use and passes them on (`on_hello`,
    `on_telemetry`, `on_kv`), so each message is decoded once."""

    def __init__(
        self,
        core: RouterCore,
        settings: SwitchyardSettings,
        replica_id: str,
        *,
        artifact_poll_s: float | None = None,
        history_depth: int = 16,
    ) -> None:
        self.core, self.settings, self.replica_id = core, settings, replica_id
        #: None: watch the artifact's key (a consumer); seconds: read it that often, one message at a time.
        self.artifact_poll_s = artifact_poll_s
        self.history_depth = history_depth
        self.ready = asyncio.Event()
        self._asked: dict[str, float] = {}  # engine id -> when we last asked it to announce itself
        self._refresh_due = False
        self._tasks: list[asyncio.Task[None]] = []
        self._bus: Bus | None = None
        self._revision = 0  # the artifact revision last read (polling)
        self._signing_key: bytes | None = None
        #: A gateway's session table (`Sessions.learn`): called with each admitted peer batch naming sessions.
        self.on_sessions: Callable[[str, RouteDecisions, float], None] | None = None

    # ----- messages (sync where possible: no task per message) -----

    def on_hello(self, hello: Hello, _msg: Msg | None = None) -> None:
        self.core.on_hello(hello, time.monotonic())
        self.refresh_soon()

    def on_telemetry(self, telemetry: Telemetry, _msg: Msg | None = None) -> None:
        now = time.monotonic()
        known = self.core.on_telemetry(telemetry, now)
        self.refresh_soon()
        if not known and self._bus is not None:
            # an engine we have no hello from: ask it to introduce itself, at most once a second
            if now - self._asked.get(telemetry.engine_id, -math.inf) < ANNOUNCE_INTERVAL_S:
                return
            if len(self._asked) > 10_000:
                self._asked.clear()
            self._asked[telemetry.engine_id] = now
            bus = self._bus
            payload = encode_unchecked(Announce, {"requester": self.replica_id, "engine_id": telemetry.engine_id})
            task = asyncio.get_running_loop().create_task(bus.nc.publish(bus.subjects.announce, payload))
            task.add_done_callback(_quiet)

    def on_kv(self, events: KvEvents, _msg: Msg | None = None) -> None:
        self.core.on_kv(events, time.monotonic())

    def admit_decisions(self, msg: Msg) -> bool:
        """Before decoding: our own batches are skipped, and a sender over its byte rate is dropped unread
        (`DecisionBounds.admit_message`: the subject names the sender, which may publish only under its own)."""
        sender = self._sender(msg.subject)
        if sender is None:
            return True  # not a replica's subject: the decoder's sender check deals with it
        if sender.endswith("." + self.replica_id):
            return False  # our own, counted when made
        return self.core.bounds.admit_message(sender, len(msg.data), time.monotonic())

    def _sender(self, subject: str) -> str | None:
        """`<kind>.<id>` of a `sy.route.decided.<kind>.<id>` subject (None for another subject)."""
        if self._bus is None or (replica := self._bus.subjects.decider_of(subject)) is None:
            return None
        return f"{subject.rsplit('.', 2)[1]}.{replica}"

    def on_decisions(self, decisions: RouteDecisions, msg: Msg | None = None) -> None:
        sender = self._sender(msg.subject) if msg is not None else None
        now = time.monotonic()
        self.core.on_decisions(decisions, now, sender)
        if decisions.sessions and self.on_sessions is not None and decisions.replica_id != self.replica_id:
            self.on_sessions(sender or decisions.replica_id, decisions, now)
        self.refresh_soon()  # in step in place when it can be; else re-read here, not on the next request

    def settle(self, first: Sequence[str], done: Sequence[str]) -> None:
        """This process's own progress reports (an in-process gateway's first tokens and ends): the exact ledger
        settles now, and the views are re-read off the request path."""
        self.core.fleet.on_progress(list(first), list(done), LOCAL_REPORTER, time.monotonic())
        self.refresh_soon()

    def refresh_soon(self) -> None:
        """Re-read the role views once after a burst of hellos and telemetry, off the request path.

        A decision re-reads a view itself when the fleet changed since the last read (`RoleView.refresh`, the
        same result either way); done here, that work (a dozen NumPy calls on tiny arrays, and the columns the
        profiles read: 100+ µs in a process woken cold on a loaded machine) no longer sits between a request
        and its decision.
        """
        if not self._refresh_due:
            self._refresh_due = True
            asyncio.get_running_loop().call_soon(self._refresh_views)

    def _refresh_views(self) -> None:
        self._refresh_due = False
        self.core.refresh_views(time.monotonic())

    # ----- lifecycle -----

    async def start(self, bus: Bus, ingest: Bus | None, kv_ingest: Bus | None, peers: Bus | None = None) -> None:
        """Subscribe (`ingest` None: the owner passes engine messages on; `kv_ingest` None: no KV events
        here; `peers`: the other replicas' decisions on a connection of their own, so a flood of them can get
        only that one cut off as a slow consumer, never `bus`, which serves route requests and publishes this
        replica's decisions), start the artifact reader and housekeeping, and wait up to 5 s for the artifact."""
        self._bus = bus
        self._signing_key = self.settings.artifact_key()  # read once, not at every poll
        s = bus.subjects
        if ingest is not None:
            await ingest.subscribe(s.all_hello, Hello, self.on_hello)
            await ingest.subscribe(s.all_telemetry, Telemetry, self.on_telemetry)
        if kv_ingest is not None and self.core.ingests_kv:
            await kv_ingest.subscribe(s.all_kv_events, KvEvents, self.on_kv)
        # our own are skipped by subject before decoding; others' bounded before decoding and after
        await (peers or bus).subscribe(s.route_decided, RouteDecisions, self.on_decisions, admit=self.admit_decisions)
        reader = self._watch_artifact if self.artifact_poll_s is None else self._poll_artifact
        self._tasks = [
            asyncio.create_task(supervised("routing-artifact reader", reader)),
            asyncio.create_task(self._housekeeping()),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout=5)

    async def stop(self) -> None:
        """Cancel the feed's tasks until they are done: on Python 3.11 `asyncio.wait_for` (under every nats-py
        request, e.g. the artifact poll's `kv.get`) drops a cancel that lands as its reply arrives (gh-86296),
        and the loop polls on; awaiting it once hung stop() for good (seen in tests on a loaded machine)."""
        pending = [task for task in self._tasks if not task.done()]
        while pending:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.1)
            pending = [task for task in pending if not task.done()]
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _housekeeping(self) -> None:
        while True:
            try:
                self.core.housekeeping(time.monotonic())
            except Exception:  # never let a bad tick stop the next one (metrics folding, forgetting engines)
                log.exception("router housekeeping failed")
            await asyncio.sleep(HOUSEKEEPING_S)

    # ----- the routing artifact -----

    def _use(self, artifact: RoutingArtifact | None, revision: int) -> None:
        self.core.set_artifact(artifact)
        if artifact is None:
            log.warning("routing artifact removed: routing by load only")
        else:
            log.info(
                "routing artifact v%s (K=%s, tau=%s, KV revision %s) in use",
                artifact.version,
                artifact.centroids.shape[0],
                artifact.tau,
                revision,
            )

    async def _apply(
        self, value: bytes, revision: int, older: Callable[[], Awaitable[tuple[RoutingArtifact, int] | None]]
    ) -> None:
        """Use the artifact stored at `revision`; when it is refused (counted), keep the one in use, or, with none,
        the newest valid one `older` finds (the watch reads the key's history, the poll single revisions)."""
        try:
            self._use(load_artifact(value, self.settings.max_payload_bytes, "KV artifact", self._signing_key), revision)
            return
        except ArtifactError as exc:
            metrics.ARTIFACTS_REFUSED.labels(exc.code).inc()
            log.error("ignoring routing artifact revision %s: %s", revision, exc)
        if self.core.artifact is not None:
            return  # keep the one in use
        found = await older()
        if found is not None:
            log.warning("using the last valid routing artifact, KV revision %s", found[1])
            self._use(*found)

    async def _watch_artifact(self) -> None:
        """Load the current artifact, then apply every update to the KV key as it happens."""
        assert self._bus is not None
        subjects, signing_key, limit = self._bus.subjects, self._signing_key, self.settings.max_payload_bytes
        kv = await self._bus.ensure_kv(subjects.router_bucket)
        watcher = await kv.watch(subjects.artifact_key)
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values: ready even without an artifact
                    self.ready.set()
                    continue
                if entry.value is None or entry.operation in ("DEL", "PURGE"):
                    self._use(None, entry.revision)
                    continue
                await self._apply(
                    entry.value,
                    entry.revision,
                    lambda: last_valid_artifact(kv, subjects.artifact_key, limit, signing_key),
                )
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _poll_artifact(self) -> None:
        """Read the artifact's key every `artifact_poll_s`, applying a new revision as the watch would."""
        assert self._bus is not None and self.artifact_poll_s is not None
        kv: KeyValue | None = None
        while True:
            try:
                if kv is None:
                    kv = await self._bus.js.key_value(self._bus.subjects.router_bucket)
                await self._read_once(kv)
            except (NotFoundError, KeyNotFoundError):
                pass  # no bucket or no artifact yet: routing by load only until one is written
            except Exception as exc:  # the bus is away; the artifact in use stays
                log.debug("routing artifact read failed: %s", exc)
            self.ready.set()
            await asyncio.sleep(self.artifact_poll_s)

    async def _read_once(self, kv: KeyValue) -> None:
        assert self._bus is not None
        key_name, signing_key = self._bus.subjects.artifact_key, self._signing_key
        try:
            entry = await kv.get(key_name)
        except KeyNotFoundError:  # never written, or deleted/purged (nats-py raises for both)
            if self._revision and self.core.artifact is not None:
                self._use(None, self._revision)
            self._revision = 0
            return
        if entry.revision == self._revision:
            return
        self._revision = revision = entry.revision
        limit = self.settings.max_payload_bytes
        await self._apply(
            entry.value or b"",
            revision,
            lambda: last_valid_by_get(kv, key_name, limit, signing_key, revision, self.history_depth),
        )


def _quiet(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an announce lost while the bus is away is asked again a second later


async def join_replicas(
    feed: CoreFeed,
    bus: Bus,
    settings: SwitchyardSettings,
    servers: list[str] | None,
    role: str,
    replica_id: str,
    shares: bool,
    how_to_share: str,
) -> tuple[DecisionSharer | None, Bus]:
    """What an in-process decider (a gateway replica, an endpoint picker) does to count as one of the replicas:
    share its decisions under its own `sy.route.decided.gateway.<id>` when its NATS user may (else say once why
    not, and `how_to_share`), read the others' on a connection of its own (`<id>-peers`: a flood of them cut off
    as a slow consumer takes nothing else with it), and start the feed. Returns the sharer and that connection."""
    sharer = None
    if shares:
        decided = bus.subjects.decided("gateway", replica_id)
        sharer = DecisionSharer(bus, replica_id, feed.core.settings.share_interval_s, decided)
    else:
        log.warning(
            "%s connects as the shared `gateway` user, which may not publish decisions: other replicas will not "
            "count this one's (give it its own: %s)",
            replica_id,
            how_to_share,
        )
    peers = await Bus.connect(settings, name=f"{replica_id}-peers", servers=servers, role=role)
    await feed.start(bus, None, None, peers)
    return sharer, peers
