"""Durable JetStream consumers belong to one role each (issue 29, item 2), on a real nats-server with the
generated per-role configuration.

Every role, `readonly` and `loadgen` included, could create and update consumers on the contract streams and
pull and ack from them: as `readonly`, rewriting the migration service's durable filter skipped plans for
ever and stalled placement. Now only a durable's owner may create, update, inspect, pull from, acknowledge on
or delete it; the others are refused by the server (and it logs the violation), and the durable is unchanged.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from nats.js.api import ConsumerConfig
from sqlalchemy import select

from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.nats_auth import SERVICE_ROLES, engine_user
from switchyard.shared.subjects import Durable
from tests import test_nats_permissions as permissions
from tests.fleet_helpers import hello
from tests.helpers import eventually
from tests.test_nats_permissions import SecuredNats

#: The module's own secured nats-server (the generated per-role configuration) and admin connection.
secured = permissions.secured
admin = permissions.admin

#: Every role but `admin`: none may touch a durable it does not own.
ROLES = [*(r for r in SERVICE_ROLES if r != "admin"), "fleet", engine_user("e0")]


def _config(durable: Durable, filter_subject: str, *, name_only: bool = False) -> bytes:
    """A consumer create/update request for `durable` with `filter_subject` (as a raw attacker sends it)."""
    key = "name" if name_only else "durable_name"
    config = {key: durable.name, "filter_subject": filter_subject, "ack_policy": "explicit", "max_deliver": -1}
    return json.dumps({"stream_name": durable.stream, "config": config}).encode()


def _attacks(durable: Durable, elsewhere: str, ack_subject: str) -> dict[str, tuple[str, bytes]]:
    """What a holder of another role's credentials would try on `durable`: name -> (subject, payload).

    `elsewhere`: another subject of the durable's stream (a rewritten filter the server accepts);
    `ack_subject`: the reply subject of a message the owner holds unacknowledged.
    """
    api, stream, name = "$JS.API", durable.stream, durable.name
    return {
        "update (legacy durable create)": (
            f"{api}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            _config(durable, elsewhere),
        ),
        "update (named create)": (f"{api}.CONSUMER.CREATE.{stream}.{name}", _config(durable, elsewhere)),
        "update (named create with filter)": (
            f"{api}.CONSUMER.CREATE.{stream}.{name}.{elsewhere}",
            _config(durable, elsewhere),
        ),
        # the nameless (ephemeral) create, with the durable's name in the body: nats-server takes it as an update
        "update (ephemeral create naming it)": (
            f"{api}.CONSUMER.CREATE.{stream}",
            _config(durable, elsewhere, name_only=True),
        ),
        "info": (f"{api}.CONSUMER.INFO.{stream}.{name}", b""),
        "pull": (f"{api}.CONSUMER.MSG.NEXT.{stream}.{name}", json.dumps({"batch": 1}).encode()),
        "ack": (ack_subject, b"+ACK"),
        "delete": (f"{api}.CONSUMER.DELETE.{stream}.{name}", b""),
    }


@pytest.fixture
async def owners(secured: SecuredNats, admin: Bus) -> AsyncIterator[dict[str, Bus]]:
    """A connection per durable owner (placement, migration), each with its durable created."""
    buses = {
        d.role: await Bus.connect(secured.settings(), name=d.role, role=d.role) for d in secured.subjects.durables()
    }
    yield buses
    for bus in buses.values():
        await bus.close()


@pytest.mark.parametrize("role", ROLES)
async def test_only_a_durables_owner_may_update_read_pull_ack_or_delete_it(
    secured: SecuredNats,
    admin: Bus,
    owners: dict[str, Bus],
    role: str,
) -> None:
    subjects = secured.subjects
    nc = await secured.raw(role)
    held: list = []
    try:
        for durable in subjects.durables():
            owner = owners[durable.role]
            elsewhere = next(x for x in subjects.streams()[durable.stream] if x != durable.filter_subject)
            pull = await owner.durable_pull(durable, ack_wait=60.0, max_deliver=-1)
            await admin.js.publish(durable.filter_subject, f"for-{durable.name}-{uuid.uuid4().hex}".encode())
            [message] = await pull.fetch(1, timeout=10)  # the owner pulls it and holds it unacknowledged
            held.append((durable, pull, message))
            if role == durable.role:  # positive control: the owner may update it, read it, pull and ack
                await owner.ensure_durable(durable, ack_wait=60.0, max_deliver=-1)
                assert (await owner.js.consumer_info(durable.stream, durable.name)).num_ack_pending == 1
                continue
            attacks = _attacks(durable, elsewhere, message.reply)
            before = len(secured.violations())
            for subject, payload in attacks.values():
                await nc.publish(subject, payload, reply=f"_INBOX_{role}.{uuid.uuid4().hex}")
            marker = f"{subjects.prefix}.marker.{uuid.uuid4().hex}"  # no role but admin may publish here
            await nc.publish(marker)
            await nc.flush()
            # one connection's messages are handled in order: once the marker is refused, so is all before it
            await eventually(lambda before=before, marker=marker: _refused(secured, before, marker), timeout=30)
            refused = secured.violations()[before:]
            allowed = [what for what, (subject, _) in attacks.items() if not any(subject in v for v in refused)]
            assert allowed == [], f"{role} may {allowed} {durable.name!r}"
            info = await admin.js.consumer_info(durable.stream, durable.name)  # still there, as the owner set it
            assert (info.config.filter_subject, info.config.filter_subjects) == (durable.filter_subject, None)
            assert info.num_ack_pending == 1  # the owner's message is still its own to acknowledge
    finally:
        await nc.close()
        for _durable, pull, message in held:
            await message.ack_sync()
            await pull.unsubscribe()
    for durable in subjects.durables():
        assert (await admin.js.consumer_info(durable.stream, durable.name)).num_ack_pending == 0  # owner acked


async def _refused(secured: SecuredNats, before: int, subject: str) -> bool:
    return any(subject in line for line in secured.violations()[before:])


@pytest.mark.parametrize("role", ["readonly", "loadgen", "router", "api", "migration", "fleet"])
async def test_a_role_without_a_consumer_of_the_stream_cannot_relay_its_bytes_onto_an_engines_subject(
    secured: SecuredNats, admin: Bus, role: str
) -> None:
    """An engine's credentials store any bytes on the routing-samples stream, and a push consumer's deliver
    subject is its creator's choice: nats-server delivers there whatever the creator may publish. So with the
    credentials of any role but `gateway` and the engines, a consumer delivering those bytes to e1's hello
    subject made a hello in e1's name that passes every check (it arrives on e1's own subject). Only `fit`
    reads that stream through consumers now; the others still read single messages (positive control)."""
    subjects = secured.subjects
    stream = subjects.routing_samples_stream
    forged = encode(hello("e1", "g-forged", ["forged-gpu"], role="decode"))
    e0 = await secured.raw(engine_user("e0"))
    reader, router = await secured.raw(role), await secured.raw("router")
    got: list[bytes] = []

    async def on_hello(msg) -> None:
        got.append(msg.data)

    try:
        seq = (await e0.jetstream().publish(subjects.routing_samples, forged)).seq  # stored as a "sample"
        consumers = (await admin.js.stream_info(stream)).state.consumer_count
        await router.subscribe(subjects.hello("e1"), cb=on_hello)
        await router.flush()
        relay = {"deliver_subject": subjects.hello("e1"), "deliver_policy": "last", "ack_policy": "none"}
        create = f"$JS.API.CONSUMER.CREATE.{stream}"
        before = len(secured.violations())
        await reader.publish(
            create, json.dumps({"stream_name": stream, "config": relay}).encode(), reply=f"_INBOX_{role}.x"
        )
        marker = f"{subjects.prefix}.marker.{uuid.uuid4().hex}"
        await reader.publish(marker)
        await reader.flush()
        await eventually(lambda: _refused(secured, before, marker), timeout=30)
        refused = any(create in line for line in secured.violations()[before:])
        if not refused:  # show what it allowed: the stored bytes arrive as e1's hello
            await eventually(lambda: _true(forged in got), timeout=10)
        assert refused and got == [], f"{role} relayed a hello in e1's name"
        assert (await admin.js.stream_info(stream)).state.consumer_count == consumers
        # positive control: single messages by sequence, no consumer, no violation
        before = len(secured.violations())
        assert (await reader.jetstream().get_msg(stream, seq)).data == forged
        assert secured.violations()[before:] == []
    finally:
        for nc in (e0, reader, router):
            await nc.close()


async def _true(value: bool) -> bool:
    return value


async def test_readonly_cannot_make_the_migration_service_skip_plans(
    secured: SecuredNats,
    admin: Bus,
    tmp_path: Path,
) -> None:
    """The issue's attack: as `readonly`, rewrite the migration durable's filter (to the calibration requests),
    then placement publishes a plan. It was skipped for ever (and placement stalled on it); now the rewrite is
    refused and the plan is executed: the engine really moves its experts."""
    from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
    from switchyard.services.migration.service import MigrationService
    from switchyard.services.migration.settings import MigrationSettings
    from switchyard.shared.db import Migration, Placement, create_async_db, upgrade
    from switchyard.solver.placement.layouts import default_layout
    from tests.fleet_helpers import announcing, plan, shuffled

    subjects = secured.subjects
    durable = subjects.migration_plans
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
    upgrade(database_url)
    settings = secured.settings(database_url=database_url)
    group = "ga" + uuid.uuid4().hex[:6]
    base = default_layout(4, 8, 2)
    engine_group = SimExpertGroup(group, base.copy(), MigrationCost(time_scale=0.0))
    e1 = await Bus.connect(settings, name="e1", role=engine_user("e1"))
    placement = await Bus.connect(settings, name="placement", role="placement")
    readonly = await secured.raw("readonly")
    # reconcile_s: the recovery of skipped plans stays out of this test (it is the permission that must hold)
    service = MigrationService(settings, MigrationSettings(step_timeout_s=2.0, retry_backoff_s=0.05, reconcile_s=3600))
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    engine, sessions = create_async_db(database_url)
    try:
        await serve_migrate(e1, "e1", engine_group)
        async with announcing(e1, hello("e1", group, [f"{group}-gpu0", f"{group}-gpu1"], dp_rank=0)):
            await eventually(lambda: _true(service.fleet.coordinator(group) == "e1"), timeout=30)
            await eventually(lambda: _consumer_exists(admin, durable), timeout=30)
            rewrite = ConsumerConfig(
                durable_name=durable.name,
                filter_subject=subjects.calibration_request,
                ack_policy="explicit",
                ack_wait=30.0,
                max_deliver=-1,
            )
            try:
                await readonly.jetstream().add_consumer(durable.stream, config=rewrite, timeout=2.0)
                rewritten = True
            except Exception:  # the server drops the request: a timeout
                rewritten = False
            target = plan(group, 1, shuffled(base, 3))
            await placement.js_publish(subjects.placement_plan, target, msg_id=target.plan_id)

            async def applied() -> bool:
                async with sessions() as session:
                    status = await session.scalar(select(Placement.status).where(Placement.plan_id == target.plan_id))
                    state = await session.scalar(
                        select(Migration.state)
                        .join(Placement, Placement.id == Migration.placement_id)
                        .where(Placement.plan_id == target.plan_id)
                    )
                return status == "applied" and state == "succeeded"

            await eventually(applied, timeout=30)
        np.testing.assert_array_equal(engine_group.layout, target.placement)
        assert not rewritten
        assert any("readonly" in v and f"CONSUMER.DURABLE.CREATE.{durable.stream}" in v for v in secured.violations())
    finally:
        stop.set()
        await asyncio.wait_for(running, 15)
        await engine.dispose()
        await readonly.close()
        for bus in (e1, placement):
            await bus.close()


async def _consumer_exists(admin: Bus, durable: Durable) -> bool:
    from nats.js.errors import NotFoundError

    try:
        await admin.js.consumer_info(durable.stream, durable.name)
    except NotFoundError:
        return False
    return True
