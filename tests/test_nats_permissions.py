"""Per-role bus permissions against a real nats-server started with the generated configuration.

An attacker with an engine's credentials publishes raw bytes (not through our helpers): what the server lets
through is what matters. Every refusal is checked against a positive control (the right role can do it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest
from sqlalchemy import select

from switchyard.services.gateway.service import GatewayService
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.embedded import EmbeddedNats, find_nats_server
from switchyard.shared.nats_auth import SERVICE_ROLES, Credentials, engine_user, gateway_user, render_authorization
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects
from tests.fleet_helpers import hello
from tests.helpers import eventually

FLEET = ["sim-p0", "sim-p1", "sim-d0", "sim-d1", "sim-d2", "sim-d3"]


@dataclass
class SecuredNats:
    server: EmbeddedNats
    subjects: Subjects
    credentials: Credentials
    credentials_path: Path

    def settings(self, **extra: object) -> SwitchyardSettings:
        return SwitchyardSettings(
            nats_servers=[self.server.url],
            subject_prefix=self.subjects.prefix,
            nats_credentials=self.credentials_path,
            nats_initial_connect_s=3.0,
            # These tests take engines without a manifest unless they give one: the operator's explicit opt-out
            # (per-role credentials make strict mode the default; tests/test_unlisted_engines.py tests it).
            **{"engine_strict": False, **extra},  # type: ignore[arg-type]
        )

    async def raw(self, role: str) -> nats.NATS:
        """A plain nats-py connection as `role` (what a hostile holder of those credentials would use)."""
        creds = self.credentials.users[role]
        return await nats.connect(
            self.server.url,
            user=creds["user"],
            password=creds["password"],
            inbox_prefix=f"_INBOX_{creds['user']}",
            allow_reconnect=False,
            error_cb=_ignore,
        )

    def violations(self) -> list[str]:
        return re.findall(r".*(?:Publish|Subscription) Violation.*", self.server.log_path.read_text(errors="replace"))

    def refused(self, user: str) -> list[str]:
        """The subjects the server refused `user` (exactly that user: `gateway` is not `gateway-g1`)."""
        return [
            re.search(r'Subject "([^"]*)"', line).group(1)  # type: ignore[union-attr]
            for line in self.violations()
            if f'user:{user}"' in line and 'Subject "' in line
        ]


async def _ignore(_exc: Exception) -> None:
    pass


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredNats]:
    folder = tmp_path_factory.mktemp("secured-nats")
    subjects = Subjects("p" + uuid.uuid4().hex[:8])
    engines = [engine_user(e) for e in ("e0", "e1", "p0", "d0")]
    roles = [*SERVICE_ROLES, "fleet", *engines, gateway_user("g1"), gateway_user("g2")]
    credentials = Credentials.generate(roles)
    path = folder / "credentials.json"
    credentials.save(path)
    block = render_authorization(subjects, credentials, fleet_engines=FLEET)
    server = EmbeddedNats(folder / "nats", extra_config=block)
    server.start()
    yield SecuredNats(server, subjects, credentials, path)
    server.stop()


@pytest.fixture
async def admin(secured: SecuredNats) -> AsyncIterator[Bus]:
    bus = await Bus.connect(secured.settings(), name="admin", role="admin")
    await bus.ensure_streams()
    yield bus
    await bus.close()


async def _received(nc: nats.NATS, subject: str | list[str], send, until: bytes | None = None) -> list[bytes]:
    """What subscriptions on `subject`(s) (on connection `nc`) receive while `send()` runs.

    With `until`: wait (bounded) for that message, the sender's last, then stop. NATS keeps one publisher's
    order, so anything the server let through before it has arrived too (no guess at delivery time under load).
    On a loaded machine the marker was seen not to arrive (about 1 run in 5); `send()` is then repeated, which
    keeps the argument (every copy of the marker follows the refused messages) and the marker's copies are
    reported once.
    """
    got: list[bytes] = []

    async def on_message(msg) -> None:
        got.append(msg.data)

    subs = [await nc.subscribe(one, cb=on_message) for one in ([subject] if isinstance(subject, str) else subject)]
    await nc.flush()
    await send()
    if until is None:
        await asyncio.sleep(0.3)
    else:
        async with asyncio.timeout(30):
            while until not in got:
                for _ in range(300):  # 3 s for this copy of the marker
                    if until in got:
                        break
                    await asyncio.sleep(0.01)
                else:
                    await send()
    for sub in subs:
        await sub.unsubscribe()
    return [data for i, data in enumerate(got) if data != until or until not in got[:i]]


def _async(condition):
    """`eventually` polls a coroutine; these conditions are plain reads."""

    async def probe() -> bool:
        return bool(condition())

    return probe


def _hello(engine_id: str) -> s.Hello:
    return hello(engine_id, "g0", ["gpu0"], role="decode")


async def test_a_client_without_credentials_is_refused(secured: SecuredNats) -> None:
    anonymous = SwitchyardSettings(nats_servers=[secured.server.url], nats_initial_connect_s=0.5)
    with pytest.raises(ConnectionError, match="uthoriz"):
        await Bus.connect(anonymous, name="anonymous")
    wrong = secured.credentials.users["router"] | {"password": "not-the-password"}
    with pytest.raises(Exception, match="uthoriz"):
        await nats.connect(secured.server.url, user=wrong["user"], password=wrong["password"], allow_reconnect=False)


async def test_an_engine_cannot_write_the_routing_artifact(secured: SecuredNats, admin: Bus) -> None:
    bucket, key = secured.subjects.router_bucket, secured.subjects.artifact_key
    kv = await admin.ensure_kv(bucket)
    fit = await secured.raw("fit")
    engine = await secured.raw(engine_user("e0"))
    try:
        fit_kv = await fit.jetstream().key_value(bucket)
        await fit_kv.put(key, b"from-fit")  # positive control: the fit job may
        assert (await kv.get(key)).value == b"from-fit"
        await engine.publish(f"$KV.{bucket}.{key}", b"from-engine")  # a raw write, as an attacker would
        await engine.flush()
        with pytest.raises(Exception):  # noqa: B017 - permission refusal surfaces as a timeout or an error
            await engine.jetstream().key_value(bucket)  # nor may it read the bucket's stream API
        await asyncio.sleep(0.2)
        assert (await kv.get(key)).value == b"from-fit"
        for role in ("router", "placement", "migration", "api", "readonly", "loadgen"):
            other = await secured.raw(role)
            await other.publish(f"$KV.{bucket}.{key}", b"from-" + role.encode())
            await other.flush()
            await other.close()
        await asyncio.sleep(0.2)
        assert (await kv.get(key)).value == b"from-fit"
    finally:
        await kv.purge(key)  # leave no garbage artifact for the loop test on this server
        await fit.close()
        await engine.close()
    assert any(f"$KV.{bucket}.{key}" in line for line in secured.violations())


async def test_an_engine_cannot_publish_a_plan(secured: SecuredNats, admin: Bus) -> None:
    stream, subject = secured.subjects.placement_stream, secured.subjects.placement_plan
    before = (await admin.js.stream_info(stream)).state.messages
    engine, placement = await secured.raw(engine_user("e0")), await secured.raw("placement")
    try:
        await engine.publish(subject, b"plan-from-engine")
        await engine.flush()
        await asyncio.sleep(0.2)
        assert (await admin.js.stream_info(stream)).state.messages == before
        await placement.jetstream().publish(subject, b"plan-from-placement")  # positive control
        assert (await admin.js.stream_info(stream)).state.messages == before + 1
    finally:
        await engine.close()
        await placement.close()


async def test_only_the_migration_service_sends_migrate_requests(secured: SecuredNats) -> None:
    subject = secured.subjects.migrate("e1")
    target = await secured.raw(engine_user("e1"))
    senders = {role: await secured.raw(role) for role in (engine_user("e0"), "router", "api", "migration")}
    try:
        for role, nc in senders.items():

            async def send(nc: nats.NATS = nc, role: str = role) -> None:
                await nc.publish(subject, role.encode())
                await nc.flush()

            got = await _received(target, subject, send, until=b"migration" if role == "migration" else None)
            assert got == ([b"migration"] if role == "migration" else []), role
    finally:
        await target.close()
        for nc in senders.values():
            await nc.close()


async def test_an_engine_cannot_speak_for_another_engine(secured: SecuredNats) -> None:
    subjects = secured.subjects
    router, e0 = await secured.raw("router"), await secured.raw(engine_user("e0"))
    got: list[bytes] = []

    async def on_message(msg) -> None:
        got.append(msg.data)

    try:
        for subject in (subjects.all_hello, subjects.all_telemetry):
            await router.subscribe(subject, cb=on_message)
        await router.flush()
        # e1's name first, then e0's own: one publisher's order is kept, so once e0's two messages are in,
        # anything the server let through in e1's name would have arrived before them (no sleep to guess).
        for engine_id in ("e1", "e0"):
            await e0.publish(subjects.hello(engine_id), f"{engine_id}-hello".encode())
            await e0.publish(subjects.telemetry(engine_id), f"{engine_id}-telemetry".encode())
        await e0.flush()
        await eventually(_async(lambda: len(got) >= 2), timeout=30)
        assert got == [b"e0-hello", b"e0-telemetry"]  # its own, both kinds; none in e1's name
        # nor can it listen to another engine's requests: the server refuses the subscription and logs it
        await e0.subscribe(subjects.migrate("e1"), cb=on_message)
        await e0.flush()
        await eventually(_async(lambda: any(subjects.migrate("e1") in v for v in secured.violations())), timeout=30)
    finally:
        await router.close()
        await e0.close()


async def test_a_payload_naming_another_engine_is_refused_and_counted(secured: SecuredNats) -> None:
    """The subject is the engine's proof of identity; a hello on e0's subject that claims e1 is dropped."""
    router = await Bus.connect(secured.settings(), name="router", role="router")
    e0 = await Bus.connect(secured.settings(), name="e0", role=engine_user("e0"))
    seen: list[str] = []
    try:
        await router.subscribe(secured.subjects.all_hello, s.Hello, lambda m, _: seen.append(m.engine_id))
        await router.nc.flush()
        before = rejected_count(secured.subjects.all_hello, "engine_id_mismatch")
        await e0.publish(secured.subjects.hello("e0"), _hello("e1"))
        await e0.publish(secured.subjects.hello("e0"), _hello("e0"))
        await e0.nc.flush()
        await eventually(
            _async(lambda: bool(seen)), timeout=30
        )  # the rejected hello was sent first, so it has been handled by now
        assert seen == ["e0"]
        assert rejected_count(secured.subjects.all_hello, "engine_id_mismatch") == before + 1
    finally:
        await router.close()
        await e0.close()


@pytest.mark.parametrize("role", ["gateway", gateway_user("g1")])
async def test_the_gateway_can_only_ask_the_router(secured: SecuredNats, admin: Bus, role: str) -> None:
    """The gateway faces clients, so its credentials are the likeliest to leak: they must not write the routing
    artifact, publish a plan, send a migrate request or speak as an engine, neither the shared user nor a
    replica's own (`gateway-g1`, which may also publish its decisions: a grant that must add nothing else).
    Positive control: it may ask `route.dp` (the router's subscription gets the question)."""
    subjects = secured.subjects
    bucket, key = subjects.router_bucket, subjects.artifact_key
    kv = await admin.ensure_kv(bucket)
    plans_before = (await admin.js.stream_info(subjects.placement_stream)).state.messages
    artifact_before = await _kv_value(kv, key)
    gateway, router = await secured.raw(role), await secured.raw("router")
    e1 = await secured.raw(engine_user("e1"))
    try:
        await gateway.publish(f"$KV.{bucket}.{key}", b"from-gateway")
        await gateway.publish(subjects.placement_plan, b"plan-from-gateway")
        await gateway.flush()

        async def as_an_engine() -> None:
            await gateway.publish(subjects.hello("e0"), b"gateway-hello")
            await gateway.publish(subjects.telemetry("e0"), b"gateway-telemetry")
            await gateway.publish(subjects.signature("e0"), b"gateway-signature")
            await gateway.publish(subjects.route_dp, b"question")  # positive control, and the end marker
            await gateway.flush()

        watched = [subjects.all_hello, subjects.all_telemetry, subjects.route_dp]
        seen_by_router = await _received(router, watched, as_an_engine, until=b"question")

        async def migrate() -> None:
            await gateway.publish(subjects.migrate("e1"), b"gateway-migrate")
            await gateway.publish(subjects.announce, b"announce")  # allowed: the end marker
            await gateway.flush()

        seen_by_engine = await _received(e1, [subjects.migrate("e1"), subjects.announce], migrate, until=b"announce")
        with pytest.raises(Exception):  # noqa: B017 - no JetStream API but the artifact's reads: refused or timeout
            await gateway.jetstream().stream_info(subjects.placement_stream, timeout=0.5)
    finally:
        await gateway.close()
        await router.close()
        await e1.close()
    assert seen_by_router == [b"question"] and seen_by_engine == [b"announce"]
    assert (await admin.js.stream_info(subjects.placement_stream)).state.messages == plans_before
    assert await _kv_value(kv, key) == artifact_before
    refused = secured.refused(role)
    as_engine = [subjects.hello("e0"), subjects.telemetry("e0"), subjects.signature("e0")]
    for subject in (f"$KV.{bucket}.{key}", subjects.placement_plan, *as_engine, subjects.migrate("e1")):
        assert subject in refused, subject


async def test_a_gateway_replica_publishes_decisions_only_in_its_own_name(secured: SecuredNats) -> None:
    """Every replica counts the decisions on `sy.route.decided.>` as work in flight on the chosen engines, so
    whoever publishes there in another's name makes all of them avoid engines nobody sent work to. Reproduces
    that attack with the old single `sy.route.decided` subject (any sender, any name) or a `decided.gateway.*`
    grant: `gateway-g1` publishing as replica g2 and as router r1, the shared `gateway` user publishing at all.
    Positive controls: g1's own subject reaches a subscriber of every replica's decisions; so does the shared
    user's `route.dp` question (its marker)."""
    subjects = secured.subjects
    router, g1 = await secured.raw("router"), await secured.raw(gateway_user("g1"))
    shared = await secured.raw("gateway")
    watched = [subjects.route_decided, subjects.route_dp]
    forged = [subjects.decided("gateway", "g2"), subjects.decided("router", "r1")]
    try:

        async def as_others() -> None:
            for subject in forged:
                await g1.publish(subject, b"forged-by-g1")
            await g1.publish(subjects.decided("gateway", "g1"), b"own")  # allowed: the end marker
            await g1.flush()

        async def as_shared() -> None:
            for subject in [subjects.decided("gateway", "g1"), *forged]:
                await shared.publish(subject, b"forged-by-gateway")
            await shared.publish(subjects.route_dp, b"question")  # allowed: the end marker
            await shared.flush()

        from_g1 = await _received(router, watched, as_others, until=b"own")
        from_shared = await _received(router, watched, as_shared, until=b"question")
    finally:
        for nc in (router, g1, shared):
            await nc.close()
    assert from_g1 == [b"own"] and from_shared == [b"question"]
    assert set(forged) <= set(secured.refused(gateway_user("g1")))
    assert {*forged, subjects.decided("gateway", "g1")} <= set(secured.refused("gateway"))


async def test_a_gateway_replica_reads_the_artifact_without_a_consumer(secured: SecuredNats, admin: Bus) -> None:
    """An in-process gateway reads the routing artifact, one message at a time. A consumer it may not create:
    its deliver subject is the creator's choice, so a consumer could relay the stored artifact onto any subject,
    `$KV.<bucket>.<key>` included (writing back an old artifact: a rollback). Reproduces, before the fix, a
    gateway that could not read the artifact at all (no JetStream API); and guards against a role that reads it
    through a consumer (`kv.watch`, an ephemeral `CONSUMER.CREATE`), which then succeeds."""
    bucket, key = secured.subjects.router_bucket, secured.subjects.artifact_key
    kv = await admin.ensure_kv(bucket)
    gateway = await secured.raw(gateway_user("g1"))
    try:
        await kv.put(key, b"the-artifact")
        readable = await gateway.jetstream().key_value(bucket)  # the bucket's stream info
        assert (await readable.get(key)).value == b"the-artifact"  # a direct (single-message) read
        with pytest.raises(Exception):  # noqa: B017 - a refusal surfaces as a timeout or an error
            await readable.watch(key)
    finally:
        await kv.purge(key)  # leave no garbage artifact for the loop test on this server
        await gateway.close()
    assert f"$JS.API.CONSUMER.CREATE.KV_{bucket}" in secured.refused(gateway_user("g1"))


async def test_decisions_naming_another_replica_on_a_gateways_subject_are_refused(secured: SecuredNats) -> None:
    """The subject is a replica's proof of identity (only `gateway-g1` may publish on g1's), the payload's
    `replica_id` is not. Reproduces, without `check_sender`'s replica check, g1 passing its decisions off as
    g2's: every router would count them, and a replica skips decisions it believes its own, so g2 would not
    (nor could anyone tell who sent them). The forged batch is dropped and counted; g1's own is counted in
    flight by a router replica's core."""
    from switchyard.services.router.service import RouterService
    from switchyard.services.router.settings import RouterSettings
    from switchyard.shared.errors import ReplicaImpersonation

    subjects = secured.subjects
    settings = secured.settings()
    # No telemetry follows the hello: nothing settles the decisions the core counts in flight.
    router = RouterService(settings, RouterSettings(inflight_grace_s=60.0, fresh_load_s=5.0))
    e0 = await Bus.connect(settings, name="e0", role=engine_user("e0"))
    g1 = await Bus.connect(settings, name="g1", role=gateway_user("g1"))
    try:
        await router.start()
        await e0.publish(subjects.hello("e0"), _hello("e0"))
        await eventually(_async(lambda: "e0" in router.core.fleet.index), timeout=30)
        row = router.core.fleet.index["e0"]
        inflight = int(router.core.fleet.inflight[row])
        rejected = rejected_count(subjects.route_decided, ReplicaImpersonation.code)

        def decisions(replica_id: str, count: int) -> s.RouteDecisions:
            return s.RouteDecisions(
                replica_id=replica_id,
                kinds=["dp"] * count,
                request_ids=[f"{replica_id}-{uuid.uuid4().hex[:8]}" for _ in range(count)],
                engine_ids=["e0"] * count,
                prompt_tokens=[100] * count,
            )

        await g1.publish(subjects.decided("gateway", "g1"), decisions("g2", 5))  # first: handled before the next
        await g1.publish(subjects.decided("gateway", "g1"), decisions("g1", 2))
        await g1.nc.flush()
        await eventually(_async(lambda: router.core.fleet.inflight[row] > inflight), timeout=30)
        assert int(router.core.fleet.inflight[row]) == inflight + 2  # g1's own two, none of the forged five
        assert rejected_count(subjects.route_decided, ReplicaImpersonation.code) == rejected + 1
    finally:
        await router.stop()
        await e0.close()
        await g1.close()


async def _kv_value(kv, key: str) -> bytes | None:
    from nats.js.errors import KeyNotFoundError

    try:
        return (await kv.get(key)).value
    except KeyNotFoundError:
        return None


def _total(name: str) -> float:
    """A counter's sum over all its label values."""
    from prometheus_client import REGISTRY

    return sum(s.value for family in REGISTRY.collect() for s in family.samples if s.name == name)


async def test_a_gateway_under_its_own_credentials_still_routes(secured: SecuredNats, admin: Bus) -> None:
    """Gateway, router and stub engines each as their own NATS user: DP dispatch and a prefill->decode handoff
    (signature on the bus) go through the router, with no local fallback and no permission violation."""
    from switchyard.engine_agents.stub import StubConfig, StubEngine
    from switchyard.services.gateway.settings import GatewaySettings
    from switchyard.services.router.service import RouterService
    from switchyard.services.router.settings import RouterSettings
    from tests.gateway_helpers import router_knows, wait_for

    before = len(secured.violations())
    settings = secured.settings()
    configs = [
        StubConfig("e0", waiting_prefill_tokens=50_000),
        StubConfig("e1"),
        StubConfig("p0", role="prefill", signature_via="bus"),
        StubConfig("d0", role="decode"),
    ]
    engines = []
    for config in configs:
        bus = await Bus.connect(settings, name=config.engine_id, role=engine_user(config.engine_id))
        engines.append(StubEngine(config, bus))
    router = RouterService(settings, RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    # mode dp, then disagg, said outright: with both fleets live, `auto` keeps the one whose engines said hello
    # first, which a loaded machine may order either way
    gateway = GatewayService(settings, GatewaySettings(port=0, route_timeout_s=2.0, signature_wait_s=2.0, mode="dp"))
    fallbacks = _total("switchyard_gateway_routing_fallbacks_total")
    try:
        for engine in engines:
            await engine.start()
        await router.start()
        await gateway.start()
        await wait_for(lambda: len(gateway.registry.live()) == len(engines))  # hellos on its ingest connection
        assert gateway.ingest is not None and gateway.bus is not None and gateway.ingest.nc is not gateway.bus.nc
        await wait_for(lambda: router_knows(router, ["e0", "e1", "d0"]))
        body = {"model": "stub-model", "prompt": "hello", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            dp = [await client.post("/v1/completions", json=body) for _ in range(3)]
            gateway.gateway.mode = "disagg"
            disagg = await client.post("/v1/completions", json=body)
    finally:
        await gateway.stop()
        await router.stop()
        for engine in engines:
            await engine.stop()
            if engine.bus is not None:
                await engine.bus.close()
    assert [a.status_code for a in dp] == [200] * 3 and {a.json()["served_by"] for a in dp} == {"e1"}
    assert disagg.status_code == 200 and disagg.json()["served_by"] == "d0"
    assert len(engines[2].received) == 1  # the prefill hop went to p0
    assert _total("switchyard_gateway_routing_fallbacks_total") == fallbacks  # the router answered every question
    assert secured.violations()[before:] == []


async def test_an_inprocess_gateway_under_its_own_replica_user_shares_its_decisions(
    secured: SecuredNats, admin: Bus
) -> None:
    """The default shape end to end under per-role credentials: gateway replica g1 (user `gateway-g1`) starts,
    reads the routing artifact, decides in-process, and a router replica counts the decision in flight on the
    engine it chose; the server refused nothing. Before the fix no user could publish a gateway's decisions:
    the routers never counted a gateway's work."""
    from switchyard.engine_agents.stub import StubConfig, StubEngine
    from switchyard.services.artifacts import put_artifact_kv
    from switchyard.services.gateway.settings import GatewaySettings
    from switchyard.services.router.service import RouterService
    from switchyard.services.router.settings import RouterSettings
    from tests.gateway_helpers import core_knows, router_knows, wait_for
    from tests.test_router_service import _artifact

    await put_artifact_kv(admin, _artifact(7, ["e0", "e1"]))
    before = len(secured.violations())
    settings = secured.settings()
    configs = [StubConfig("e0", waiting_prefill_tokens=50_000), StubConfig("e1")]
    engines = []
    for config in configs:
        bus = await Bus.connect(settings, name=config.engine_id, role=engine_user(config.engine_id))
        engines.append(StubEngine(config, bus))
    # A long grace: the stubs' telemetry does not settle the shared decision before it is read here.
    router = RouterService(settings, RouterSettings(inflight_grace_s=60.0, fresh_load_s=5.0))
    gateway = GatewayService(settings, GatewaySettings(gateway_id="g1", port=0))
    fallbacks = _total("switchyard_gateway_routing_fallbacks_total")
    try:
        for engine in engines:
            await engine.start()
        await router.start()
        await gateway.start()
        assert gateway.settings.nats_credentials is not None and gateway.sharer is not None  # as gateway-g1
        assert gateway.core is not None and gateway.core.artifact is not None  # read at start (by a get)
        assert gateway.core.artifact.version == 7
        await wait_for(lambda: core_knows(gateway.core, ["e0", "e1"]), timeout_s=30)  # type: ignore[arg-type]
        await wait_for(lambda: router_knows(router, ["e0", "e1"]), timeout_s=30)
        fleet = router.core.fleet
        inflight = int(fleet.inflight[fleet.index["e1"]])
        body = {"model": "stub-model", "prompt": "hello", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            answer = await client.post("/v1/completions", json=body)
        await wait_for(lambda: fleet.inflight[fleet.index["e1"]] > inflight, timeout_s=30)
    finally:
        await (await admin.ensure_kv(secured.subjects.router_bucket)).purge(secured.subjects.artifact_key)
        await gateway.stop()
        await router.stop()
        for engine in engines:
            await engine.stop()
            if engine.bus is not None:
                await engine.bus.close()
    assert answer.status_code == 200 and answer.json()["served_by"] == "e1"
    assert _total("switchyard_gateway_routing_fallbacks_total") == fallbacks  # its core decided
    assert secured.violations()[before:] == []


def test_nats_config_command_writes_a_config_the_server_accepts(tmp_path: Path) -> None:
    out = tmp_path / "conf"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard.cli",
            "nats-config",
            "--out",
            str(out),
            "--engines",
            "e0:g0:0,e1:g0:1",
            "--gateways",
            "g0,g1",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")},
    )
    assert result.returncode == 0, result.stderr
    users = json.loads((out / "credentials.json").read_text())
    assert set(users) == {*SERVICE_ROLES, "engine-e0", "engine-e1", "gateway-g0", "gateway-g1"}
    assert "SWITCHYARD_GATEWAY_GATEWAY_ID=g1" in result.stdout  # how each replica finds its own user
    assert (out / "credentials.json").stat().st_mode & 0o077 == 0  # passwords readable by the owner only
    assert json.loads((out / "engines.json").read_text())["e1"] == {"ep_group": "g0", "dp_rank": 1}
    config = (out / "nats-server.conf").read_text()
    assert 'listen: "127.0.0.1:4222"' in config and "authorization" in config
    checked = subprocess.run([str(find_nats_server()), "-c", str(out / "nats-server.conf"), "-t"], capture_output=True)
    assert checked.returncode == 0, checked.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "nats-config", "--out", str(out), "--gateways", "g.0"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")},
    )
    assert refused.returncode == 2 and "--gateways: gateway id 'g.0'" in refused.stderr, refused.stderr


def test_the_whole_loop_runs_with_per_role_credentials(secured: SecuredNats, tmp_path: Path) -> None:
    """`switchyard up` against the secured server, each component as its own role (admin, fit, router,
    placement, migration, api, fleet, loadgen, readonly, and the gateway the load goes through): every request
    completes, ELDR has its artifact, and the server logged no permission violation for any of them."""
    before = len(secured.violations())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env |= {
        "COLUMNS": "200",
        "SWITCHYARD_NATS_CREDENTIALS": str(secured.credentials_path),
        "SWITCHYARD_SUBJECT_PREFIX": secured.subjects.prefix,
    }
    command = [sys.executable, "-m", "switchyard.cli", "up", "--nats-url", secured.server.url]
    result = subprocess.run(
        [*command, "--data-dir", str(tmp_path / "state"), "--api-port", "0", "--gateway-port", "0", "--duration", "8"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert secured.violations()[before:] == []
    sent, completed = re.search(r"(\d+) sent, (\d+) completed", result.stdout).groups()  # type: ignore[union-attr]
    assert int(sent) > 20 and completed == sent, result.stdout[-3000:]  # ~10 req/s through the gateway
    assert "through the gateway" in result.stdout
    assert "routing fallbacks" in result.stdout and "no_artifact" not in result.stdout
    assert secured.violations()[before:] == []


def test_the_shipped_config_holds_the_generated_permissions() -> None:
    """infra/nats/nats-server.conf's users are exactly what `render_authorization` makes (no drift)."""
    from switchyard.shared.nats_auth import Credentials as C

    shipped = (Path(__file__).parents[1] / "infra" / "nats" / "nats-server.conf").read_text()
    roles = [*SERVICE_ROLES, "fleet", engine_user("e0"), engine_user("e1"), gateway_user("g0")]
    block = render_authorization(Subjects("sy"), C.from_environment_references(roles), fleet_engines=FLEET)
    assert shipped.endswith(block)
    assert "password: $SWITCHYARD_NATS_PASSWORD_ROUTER," in shipped  # no password in the file itself


async def test_the_fit_role_reads_the_routing_samples_of_before_the_rename(secured: SecuredNats, admin: Bus) -> None:
    """An engine may publish routing samples; the fit job reads them, and those a pre-rename release left on
    `<P>_CALIBRATION`, under its own credentials and without a permission violation."""
    from switchyard.services.refit import read_samples

    subjects = secured.subjects
    await admin.ensure_stream(subjects.legacy_routing_samples_stream, [subjects.legacy_routing_samples])
    counts = np.ones((2, 4), np.uint16)
    old = s.RoutingSample(
        engine_id="e0",
        request_id="old",
        ts=1.0,
        prompt_tokens=1,
        decode_tokens=1,
        prefill_counts=counts,
        decode_counts=counts,
    )
    await admin.js_publish(subjects.legacy_routing_samples, old)  # as a release of before the rename did
    before = len(secured.violations())
    engine = await Bus.connect(secured.settings(), name="e0", role=engine_user("e0"))
    try:
        await engine.js_publish(subjects.routing_samples, old.model_copy(update={"request_id": "new"}))
    finally:
        await engine.close()
    fit = await Bus.connect(secured.settings(), name="fit", role="fit")
    try:
        read = await read_samples(fit)
    finally:
        await fit.close()
    ids = [x.request_id for x in read.samples]  # the module's earlier fleet published samples on the same bus
    assert ids[0] == "old" and ids[-1] == "new" and ids.count("old") == 1  # the old stream's first
    assert secured.violations()[before:] == []


async def test_without_a_manifest_an_engine_cannot_take_a_live_groups_coordinator(
    secured: SecuredNats, tmp_path: Path
) -> None:
    """Issue 15 finding 1, without an engine manifest: d0's credentials are real (its own user, its own
    subjects), but a hello naming a live group's rank-0 place, held by e1, made d0 that group's coordinator (it
    sorts first on the tie): the plan's steps went to d0, the migration was marked succeeded and e1 never moved
    an expert. A live engine's place is now its own: the forged hello is refused and counted, the steps go to e1."""
    from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
    from switchyard.services.fleet_view import UNBOUND_HELLOS
    from switchyard.services.migration.service import MigrationService
    from switchyard.services.migration.settings import MigrationSettings
    from switchyard.shared.db import Migration, create_async_db, upgrade
    from switchyard.solver.placement.layouts import default_layout
    from tests.fleet_helpers import announcing, hello, plan, shuffled
    from tests.helpers import eventually

    database_url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
    upgrade(database_url)
    settings = secured.settings(database_url=database_url)
    group_name = "gx" + uuid.uuid4().hex[:6]
    base = default_layout(4, 8, 2)
    real = SimExpertGroup(group_name, base.copy(), MigrationCost(time_scale=0.0))
    forged = SimExpertGroup(group_name, base.copy(), MigrationCost(time_scale=0.0))
    e1 = await Bus.connect(settings, name="e1", role=engine_user("e1"))
    d0 = await Bus.connect(settings, name="d0", role=engine_user("d0"))
    placement = await Bus.connect(settings, name="placement", role="placement")
    service = MigrationService(settings, MigrationSettings(step_timeout_s=2.0, retry_backoff_s=0.05))
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    engine, sessions = create_async_db(database_url)
    refused = lambda: UNBOUND_HELLOS.labels("slot_taken")._value.get()  # noqa: E731
    try:
        await serve_migrate(e1, "e1", real)
        await serve_migrate(d0, "d0", forged)
        gpus = [f"{group_name}-gpu0", f"{group_name}-gpu1"]
        async with announcing(e1, hello("e1", group_name, gpus, dp_rank=0)):

            async def e1_coordinates() -> bool:
                return service.fleet.coordinator(group_name) == "e1"

            await eventually(e1_coordinates)
            before = refused()
            async with announcing(d0, hello("d0", group_name, ["forged-gpu"], dp_rank=0)):

                async def forged_hello_handled() -> bool:  # refused (now), or believed (the old code)
                    return refused() > before or "d0" in service.fleet.engines

                await eventually(forged_hello_handled)
                assert service.fleet.coordinator(group_name) == "e1"
                target = plan(group_name, 1, shuffled(base, 1))
                await placement.js_publish(settings.subjects.placement_plan, target, msg_id=target.plan_id)

                async def finished() -> Migration | None:
                    async with sessions() as session:
                        rows = (await session.scalars(select(Migration))).all()
                    return next((m for m in rows if m.engine_group == group_name and m.state == "succeeded"), None)

                await eventually(finished, timeout=30)
        np.testing.assert_array_equal(real.layout, target.placement)  # e1 really moved the experts
        assert forged.requests == 0 and "d0" not in service.fleet.engines
        assert refused() > before
    finally:
        stop.set()
        await asyncio.wait_for(running, 15)
        await engine.dispose()
        for bus in (e1, d0, placement):
            await bus.close()
