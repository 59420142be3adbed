"""`CoreFeed` reading the routing artifact as an in-process gateway does: one message at a time, no consumer
(`services/router/feed.py`); and the decisions subject naming its replica (`shared/bus.py check_sender`)."""

from __future__ import annotations

import asyncio

from switchyard.services.artifacts import put_artifact_kv, sign_artifact
from switchyard.services.router.core import RouterCore
from switchyard.services.router.feed import CoreFeed
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.codec import encode
from switchyard.shared.schemas import RouteDecisions
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import wait_for
from tests.test_router_service import _artifact

POLL_S = 0.05


async def _feed(settings: SwitchyardSettings, bus: Bus, replica_id: str = "g0") -> CoreFeed:
    feed = CoreFeed(RouterCore(RouterSettings(replica_id=replica_id)), settings, replica_id, artifact_poll_s=POLL_S)
    await feed.start(bus, None, None)
    return feed


def _version(feed: CoreFeed) -> int | None:
    return feed.core.artifact.version if feed.core.artifact is not None else None


async def test_polling_follows_new_revisions_and_keeps_the_last_valid_one(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    kv = await bus.ensure_kv(bus.subjects.router_bucket)
    await put_artifact_kv(bus, _artifact(1, ["d0", "d1"]))
    await kv.put(bus.subjects.artifact_key, b"\x93garbage")  # the newest revision is no artifact at all
    feed = await _feed(settings, bus)
    try:
        assert _version(feed) == 1  # read before start returned: the last valid revision, found by single reads
        await put_artifact_kv(bus, _artifact(2, ["d1", "d0"]))
        await wait_for(lambda: _version(feed) == 2)
        await kv.put(bus.subjects.artifact_key, b"\x93garbage")
        await asyncio.sleep(5 * POLL_S)
        assert _version(feed) == 2  # a bad revision never replaces the one in use
        await kv.delete(bus.subjects.artifact_key)
        await wait_for(lambda: feed.core.artifact is None)  # removed on purpose: routing by load only
    finally:
        await feed.stop()


async def test_polling_takes_only_artifacts_signed_with_the_key(
    bus: Bus, settings: SwitchyardSettings, tmp_path
) -> None:
    key_file = tmp_path / "artifact.key"
    key_file.write_text("k" * 32 + "\n")
    keyed = settings.model_copy(update={"artifact_key_file": key_file})
    await put_artifact_kv(bus, sign_artifact(_artifact(1, ["d0", "d1"]), keyed.artifact_key()))
    feed = await _feed(keyed, bus)
    try:
        assert _version(feed) == 1
        await put_artifact_kv(bus, _artifact(2, ["d1", "d0"]))  # valid, re-hashed, unsigned
        await asyncio.sleep(5 * POLL_S)
        assert _version(feed) == 1
    finally:
        await feed.stop()


async def test_decisions_naming_another_replica_than_their_subject_are_refused(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """A replica may publish only under its own subject (the permissions); a message there that names another
    replica is refused and counted, and nothing is counted in flight."""
    feed = await _feed(settings, bus, "g0")
    subjects = bus.subjects
    decided = RouteDecisions(replica_id="g2", kinds=["dp"], request_ids=["r1"], engine_ids=["e0"], prompt_tokens=[9])
    counted: list[RouteDecisions] = []
    feed.core.on_decisions = lambda message, now, sender=None: counted.append(message)  # type: ignore[method-assign]
    before = rejected_count(subjects.route_decided, "replica_id_mismatch")
    try:
        await bus.nc.publish(subjects.decided("gateway", "g1"), encode(decided))  # g1's subject, g2's name
        await bus.nc.publish(subjects.decided("gateway", "g2"), encode(decided))  # its own: taken
        await wait_for(lambda: len(counted) == 1)
        await bus.nc.flush()
        assert rejected_count(subjects.route_decided, "replica_id_mismatch") == before + 1
        assert [m.replica_id for m in counted] == ["g2"]
    finally:
        await feed.stop()


async def test_stop_returns_though_a_task_lost_a_cancel(bus: Bus, settings: SwitchyardSettings) -> None:
    """On Python 3.11 `asyncio.wait_for` (under every nats-py request) drops a cancel that lands as its reply
    arrives, and the poll loop goes on: stop() must cancel again, not wait on it forever (it hung so on a loaded
    machine). The task below loses its first cancel the same way."""
    feed = await _feed(settings, bus)
    cancels = 0

    async def loses_the_first_cancel() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    task = asyncio.create_task(loses_the_first_cancel())
    await asyncio.sleep(0)
    feed._tasks.append(task)
    stopping = asyncio.create_task(feed.stop())
    done, _ = await asyncio.wait({stopping}, timeout=30)  # a guard against the hang, not a speed bound
    if not done:  # the old stop(): still awaiting the task that lost its cancel
        task.cancel()
        await stopping
    assert stopping in done, "stop() waited on a task that had lost its cancel"
    assert task.cancelled() and cancels == 2
