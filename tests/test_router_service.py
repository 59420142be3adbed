"""The router service over a real nats-server: live telemetry, staleness, hot reload, replicas, bad input."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import msgpack
import numpy as np
import pytest

from switchyard.services.artifacts import put_artifact_kv
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.artifact_hash import artifact_content_hash
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.errors import RemoteError
from switchyard.shared.schemas import (
    Announce,
    Capacity,
    Hello,
    ModelShape,
    RouteDecisions,
    RouteDecodeReply,
    RouteDecodeRequest,
    RouteDpReply,
    RouteDpRequest,
    RoutingArtifact,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings

SHAPE = ModelShape(name="toy", num_layers=2, num_experts=4, top_k=1)
_seq = itertools.count()


class Engines:
    """Test-side engine agents speaking the real protocol: hello (also on announce) and telemetry."""

    def __init__(self, bus: Bus, roles: dict[str, str], models: dict[str, str] | None = None) -> None:
        self.bus, self.roles, self.models = bus, roles, models or {}
        self.load = dict.fromkeys(roles, 0)
        self.waiting_prefill = dict.fromkeys(roles, 0)

    async def hello(self, engine_id: str) -> None:
        await self.bus.publish(
            self.bus.subjects.hello(engine_id),
            Hello(
                engine_id=engine_id,
                role=self.roles[engine_id],
                model=SHAPE.model_copy(update={"name": self.models.get(engine_id, SHAPE.name)}),
                ep_group="g0",
                gpus=["0"],
                capacity=Capacity(max_running=64, kv_blocks=1000, block_size=16),
                ts=0.0,
                agent="sim",
            ),
        )

    async def answer_announces(self) -> None:
        async def on_announce(message: Announce, _msg: object) -> None:
            for engine_id in self.roles:
                if message.engine_id in (None, engine_id):
                    await self.hello(engine_id)

        await self.bus.subscribe(self.bus.subjects.announce, Announce, on_announce)

    async def report(self, *engine_ids: str) -> None:
        for engine_id in engine_ids or tuple(self.roles):
            await self.bus.publish(
                self.bus.subjects.telemetry(engine_id),
                Telemetry(
                    engine_id=engine_id,
                    seq=next(_seq),
                    ts=0.0,
                    kv_usage=0.1,
                    num_running=self.load[engine_id],
                    num_waiting=0,
                    waiting_prefill_tokens=self.waiting_prefill[engine_id],
                    remaining_prefill_tokens=0,
                    step_time_ema=0.01,
                ),
            )
        await self.bus.nc.flush()


async def _start(settings: SwitchyardSettings, **router: object) -> RouterService:
    service = RouterService(settings, RouterSettings(**router))
    await service.start()
    return service


async def _route(bus: Bus, request_id: str = "r", signature: np.ndarray | None = None) -> RouteDecodeReply:
    return await bus.request(
        bus.subjects.route_decode,
        RouteDecodeRequest(request_id=request_id, prompt_tokens=100, signature=signature),
        RouteDecodeReply,
        timeout=2,
    )


async def _settle() -> None:
    await asyncio.sleep(0.15)


async def test_routing_follows_live_telemetry(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"d0": "decode", "d1": "decode", "d2": "decode", "p0": "prefill"})
    await engines.answer_announces()
    router = await _start(settings, policy="jsq", inflight_grace_s=0.0)
    try:
        engines.load.update(d0=5, d1=0, d2=9)
        await engines.report()
        await _settle()
        assert (await _route(bus)).engine_id == "d1"
        engines.load.update(d0=5, d1=20, d2=0)
        await engines.report()
        await _settle()
        reply = await _route(bus)
        assert reply.engine_id == "d2" and reply.policy == "jsq"
    finally:
        await router.stop()


async def test_silent_engine_receives_nothing_after_the_timeout(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"d0": "decode", "d1": "decode"})
    await engines.answer_announces()
    router = await _start(settings, policy="rr", fresh_load_s=0.4)
    try:
        await engines.report()
        await _settle()
        first = Counter([(await _route(bus, f"a{i}")).engine_id for i in range(10)])
        assert set(first) == {"d0", "d1"}
        for _ in range(6):  # d1 keeps reporting, d0 has gone silent
            await engines.report("d1")
            await asyncio.sleep(0.1)
        after = Counter([(await _route(bus, f"b{i}")).engine_id for i in range(20)])
        assert after == Counter({"d1": 20})
        await asyncio.sleep(0.5)  # now everyone is silent
        with pytest.raises(RemoteError) as info:
            await _route(bus, "c")
        assert info.value.code == "unavailable"
    finally:
        await router.stop()


def _artifact(version: int, decoder_ids: list[str]) -> RoutingArtifact:
    centroids = np.array([[1, 0, 0, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 1, 0]], np.float32) / np.sqrt(2)
    fields = dict(
        version=version,
        content_hash="0" * 16,
        created_at=0.0,
        model=SHAPE,
        representation="count",
        layer_mask=[0, 1],
        idf=np.ones((2, 4), np.float32),
        centroids=centroids,
        tau=0.1,
        rho=0.5,
        decoder_ids=decoder_ids,
    )
    draft = RoutingArtifact(**fields)
    return RoutingArtifact(**{**fields, "content_hash": artifact_content_hash(draft)})


async def test_artifact_update_changes_decisions_without_restart(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"d0": "decode", "d1": "decode"})
    await engines.answer_announces()
    await put_artifact_kv(bus, _artifact(1, ["d0", "d1"]))
    router = await _start(settings, policy="eldr", inflight_grace_s=10.0)
    try:
        await engines.report()
        await _settle()
        near_first = np.array([[9, 0, 1, 0], [8, 1, 0, 0]], np.uint16)  # close to centroid 0
        reply = await _route(bus, "x", near_first)
        assert (reply.engine_id, reply.artifact_version, reply.fallback) == ("d0", 1, None)
        await put_artifact_kv(bus, _artifact(2, ["d1", "d0"]))  # centroid 0 now belongs to d1
        for _ in range(50):
            if router.core.artifact is not None and router.core.artifact.version == 2:
                break
            await asyncio.sleep(0.05)
        await engines.report()  # clears the in-flight count of the first decision
        await _settle()
        reply = await _route(bus, "y", near_first)
        assert (reply.engine_id, reply.artifact_version) == ("d1", 2)
        no_sig = await _route(bus, "z")
        assert no_sig.fallback == "no_signature"
    finally:
        await router.stop()


async def test_replicas_share_in_flight_decisions(bus: Bus, settings: SwitchyardSettings) -> None:
    ids = [f"d{i}" for i in range(4)]
    engines = Engines(bus, dict.fromkeys(ids, "decode"))
    await engines.answer_announces()
    a = await _start(settings, policy="jsq", replica_id="replica-a", inflight_grace_s=60.0)
    b = await _start(settings, policy="jsq", replica_id="replica-b", inflight_grace_s=60.0)
    deciders: Counter[str] = Counter()
    await bus.subscribe(
        bus.subjects.route_decided, RouteDecisions, lambda m, _: deciders.update({m.replica_id: len(m.engine_ids)})
    )
    try:
        await engines.report()
        await _settle()
        replies = await asyncio.gather(*[_route(bus, f"burst{i}") for i in range(40)])
        await asyncio.sleep(0.2)  # let the last shared decisions arrive
        spread = Counter(r.engine_id for r in replies)
        # both replicas answered, and each counts every decision in flight, its own and the other's
        assert sum(spread.values()) == 40
        assert set(deciders) == {"replica-a", "replica-b"} and deciders.total() == 40
        for replica in (a, b):
            inflight = {e: replica.core.fleet.inflight[replica.core.fleet.index[e]] for e in ids}
            assert inflight == {e: spread[e] for e in ids}
        assert max(spread.values()) - min(spread.values()) <= 4  # no herding onto one "best" engine
    finally:
        await a.stop()
        await b.stop()


async def test_decisions_are_shared_in_batches_and_none_is_lost_on_stop(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"d0": "decode", "d1": "decode", "d2": "decode"})
    await engines.answer_announces()
    router = await _start(settings, policy="jsq", replica_id="replica-a", share_interval_s=0.05)
    batches: list[RouteDecisions] = []
    await bus.subscribe(bus.subjects.route_decided, RouteDecisions, lambda m, _: batches.append(m))
    try:
        await engines.report()
        await _settle()
        replies = await asyncio.gather(*[_route(bus, f"r{i}") for i in range(30)])
        await asyncio.sleep(0.2)  # the interval's timer publishes what the last bursts left
        shared = {r: (k, e) for b in batches for k, r, e in zip(b.kinds, b.request_ids, b.engine_ids, strict=True)}
        assert shared == {r.request_id: ("decode", r.engine_id) for r in replies}  # each decision, once
        assert sum(len(b.request_ids) for b in batches) == 30 and len(batches) < 30
        assert {b.replica_id for b in batches} == {"replica-a"}
        assert router.core.fleet.inflight[: len(router.core.fleet)].sum() == 30  # counted once, when made
        batches.clear()
        await _route(bus, "first")  # more than 50 ms since the last batch: shared with its reply
        await _route(bus, "second")  # within 50 ms of that: waits for the interval...
        await router.stop()  # ...which a stop does not wait out, nor drop
        await asyncio.sleep(0.2)
        assert [r for b in batches for r in b.request_ids] == ["first", "second"]
    finally:
        await router.stop()


async def test_dp_dispatch_uses_pressure(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"dp0": "dp", "dp1": "dp", "dp2": "dp"})
    await engines.answer_announces()
    router = await _start(settings, inflight_grace_s=0.0)
    try:
        engines.waiting_prefill.update(dp0=4000, dp1=100, dp2=2500)
        await engines.report()
        await _settle()
        reply = await bus.request(
            bus.subjects.route_dp, RouteDpRequest(request_id="q", prompt_tokens=700), RouteDpReply, timeout=2
        )
        assert (reply.engine_id, reply.priority) == ("dp1", 700)
    finally:
        await router.stop()


async def test_routes_go_only_to_engines_serving_the_requested_model(bus: Bus, settings: SwitchyardSettings) -> None:
    roles = {"a0": "dp", "a1": "dp", "b0": "dp", "da": "decode", "db": "decode"}
    models = {"a0": "model-a", "a1": "model-a", "b0": "model-b", "da": "model-a", "db": "model-b"}
    engines = Engines(bus, roles, models)
    await engines.answer_announces()
    router = await _start(settings, inflight_grace_s=0.0)
    try:
        # b0 is the least pressured DP engine and db the least loaded decoder: a model-blind router picks them.
        engines.waiting_prefill.update(a0=4000, a1=3000, b0=0)
        engines.load.update(da=30, db=0)
        await engines.report()
        await _settle()

        async def dp(model: str | None, i: int) -> str:
            request = RouteDpRequest(request_id=f"dp{i}", prompt_tokens=100, model=model)
            return (await bus.request(bus.subjects.route_dp, request, RouteDpReply, timeout=2)).engine_id

        async def decode(model: str | None, i: int) -> str:
            request = RouteDecodeRequest(request_id=f"d{i}", prompt_tokens=100, model=model)
            return (await bus.request(bus.subjects.route_decode, request, RouteDecodeReply, timeout=2)).engine_id

        dp_a = {await dp("model-a", i) for i in range(6)}
        dp_b = {await dp("model-b", i) for i in range(6, 9)}
        decode_a = {await decode("model-a", i) for i in range(4)}
        decode_b = {await decode("model-b", i) for i in range(4, 6)}
        assert dp_a <= {"a0", "a1"} and "a1" in dp_a and dp_b == {"b0"}
        assert decode_a == {"da"} and decode_b == {"db"}
        assert await dp(None, 9) == "b0"  # no model named (a message from before the field): every engine
        for ask in (dp, decode):
            with pytest.raises(RemoteError, match="serving 'model-c'") as refused:
                await ask("model-c", 10)
            assert refused.value.code == "unavailable"
        # an engine that switches models is filtered by its new one from its next hello on
        engines.models["b0"] = "model-a"
        await engines.hello("b0")
        await _settle()
        assert await dp("model-a", 11) == "b0"
        with pytest.raises(RemoteError):
            await dp("model-b", 12)
    finally:
        await router.stop()


async def test_malformed_requests_get_error_replies_and_are_counted(bus: Bus, settings: SwitchyardSettings) -> None:
    engines = Engines(bus, {"d0": "decode"})
    await engines.answer_announces()
    await put_artifact_kv(bus, _artifact(1, ["d0", "d0"]))
    router = await _start(settings, policy="eldr")
    subject = bus.subjects.route_decode
    try:
        await engines.report()
        await _settle()
        before = rejected_count(subject, "not_msgpack"), rejected_count(subject, "schema")
        msg = await bus.nc.request(subject, b"\xc1 definitely not msgpack", timeout=2)
        assert msgpack.unpackb(msg.data)["error"]["code"] == "not_msgpack"
        with pytest.raises(RemoteError) as info:  # 5 experts per row: the model has 4
            await _route(bus, "bad", np.ones((2, 5), np.uint16))
        assert info.value.code == "schema" and info.value.field == "signature"
        assert rejected_count(subject, "not_msgpack") == before[0] + 1
        assert rejected_count(subject, "schema") == before[1] + 1
        assert (await _route(bus, "fine", np.ones((2, 4), np.uint16))).engine_id == "d0"  # still serving
    finally:
        await router.stop()


async def test_telemetry_from_an_unknown_engine_triggers_an_announce(bus: Bus, settings: SwitchyardSettings) -> None:
    asked: list[str | None] = []
    await bus.subscribe(bus.subjects.announce, Announce, lambda m, _: asked.append(m.engine_id))
    router = await _start(settings)
    try:
        await Engines(bus, {"new-engine": "decode"}).report()
        await _settle()
        assert "new-engine" in asked and None in asked  # the start-up broadcast and the targeted ask
        for _ in range(10):  # an engine whose hello never arrives is not asked ten times a second
            await Engines(bus, {"new-engine": "decode"}).report()
        await _settle()
        assert asked.count("new-engine") == 1
    finally:
        await router.stop()


async def _wait_for_version(router: RouterService, version: int | None) -> None:
    for _ in range(60):
        current = router.core.artifact.version if router.core.artifact is not None else None
        if current == version:
            return
        await asyncio.sleep(0.05)


async def test_a_router_started_after_a_garbage_write_uses_the_last_valid_revision(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Finding 5: one garbage write to the artifact key must not disable ELDR on every router started later."""
    engines = Engines(bus, {"d0": "decode", "d1": "decode"})
    await engines.answer_announces()
    await put_artifact_kv(bus, _artifact(1, ["d0", "d1"]))
    kv = await bus.ensure_kv(bus.subjects.router_bucket)
    await kv.put(bus.subjects.artifact_key, b"\x93garbage")  # not an artifact at all
    router = await _start(settings, policy="eldr", inflight_grace_s=10.0)
    try:
        await engines.report()
        await _settle()
        near_first = np.array([[9, 0, 1, 0], [8, 1, 0, 0]], np.uint16)
        reply = await _route(bus, "x", near_first)
        assert (reply.engine_id, reply.artifact_version, reply.fallback) == ("d0", 1, None)
    finally:
        await router.stop()


async def test_with_a_key_routers_take_only_artifacts_signed_with_it(
    bus: Bus, settings: SwitchyardSettings, tmp_path
) -> None:
    """Finding 1: a re-hashed artifact (the content hash is only a checksum) written by anyone is ignored."""
    from switchyard.services.artifacts import sign_artifact

    key_file = tmp_path / "artifact.key"
    key_file.write_text("k" * 32 + "\n")
    keyed = settings.model_copy(update={"artifact_key_file": key_file})
    key = keyed.artifact_key()
    engines = Engines(bus, {"d0": "decode", "d1": "decode"})
    await engines.answer_announces()
    await put_artifact_kv(bus, sign_artifact(_artifact(1, ["d0", "d1"]), key))
    router = await _start(keyed, policy="eldr", inflight_grace_s=10.0)
    try:
        await _wait_for_version(router, 1)
        assert router.core.artifact is not None and router.core.artifact.version == 1
        await put_artifact_kv(bus, _artifact(2, ["d1", "d0"]))  # valid, re-hashed, unsigned
        await put_artifact_kv(bus, sign_artifact(_artifact(3, ["d1", "d0"]), b"another key of 32 bytes........."))
        await asyncio.sleep(0.3)
        assert router.core.artifact.version == 1  # neither replaced the signed one
        await put_artifact_kv(bus, sign_artifact(_artifact(4, ["d1", "d0"]), key))
        await _wait_for_version(router, 4)
        assert router.core.artifact.version == 4
    finally:
        await router.stop()
    unkeyed = await _start(settings, policy="eldr")  # no key configured: signed or not, a valid artifact is taken
    try:
        await _wait_for_version(unkeyed, 4)
        assert unkeyed.core.artifact is not None and unkeyed.core.artifact.version == 4
    finally:
        await unkeyed.stop()


async def test_a_decoder_the_artifact_does_not_name_stays_out_of_the_bands(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Finding 1: a phantom decoder (hello + telemetry saying it is idle) drew 555 of 600 requests."""
    engines = Engines(bus, {"d0": "decode", "d1": "decode", "phantom": "decode"})
    await engines.answer_announces()
    await put_artifact_kv(bus, _artifact(1, ["d0", "d1"]))
    router = await _start(settings, policy="eldr", inflight_grace_s=0.0)
    try:
        engines.load.update(d0=5, d1=5, phantom=0)
        await engines.report()
        await _settle()
        near_first = np.array([[9, 0, 1, 0], [8, 1, 0, 0]], np.uint16)
        chosen = Counter([(await _route(bus, f"r{i}", near_first)).engine_id for i in range(20)])
        assert chosen["phantom"] == 0 and chosen["d0"] == 20
    finally:
        await router.stop()
    opted_in = await _start(settings, policy="eldr", inflight_grace_s=0.0, unnamed_decoders_in_bands=True)
    try:
        await engines.report()
        await _settle()
        assert (await _route(bus, "new", near_first)).engine_id == "phantom"  # configured: new capacity serves
    finally:
        await opted_in.stop()


async def test_engine_ingest_has_its_own_connection(bus: Bus, settings: SwitchyardSettings) -> None:
    """Finding 3: a flood on the engines' wildcard subjects made nats-server cut services off as slow consumers.
    The router's hello/telemetry ingest is on its own connection: losing it leaves route requests answered."""
    engines = Engines(bus, {"d0": "decode", "d1": "decode"})
    await engines.answer_announces()
    router = await _start(settings, policy="jsq")
    try:
        await engines.report()
        await _settle()
        assert router.ingest is not None and router.ingest.nc is not router.bus.nc
        await router.ingest.nc.close()  # what the server does to a slow consumer
        reply = await _route(bus, "after-ingest-loss")
        assert reply.engine_id in ("d0", "d1")
    finally:
        await router.stop()


async def test_other_replicas_decisions_have_their_own_connection(bus: Bus, settings: SwitchyardSettings) -> None:
    """`make chaos --faults decision-flood`: a flood of another replica's decisions got the routers' serving
    connection cut off as a slow consumer (178 of 346 route probes failed for 11 s). The decisions now come in on
    a connection of their own: losing it leaves this replica answering route requests and sharing its own
    decisions; only the other replica's stop being counted here."""
    ids = ["d0", "d1"]
    engines = Engines(bus, dict.fromkeys(ids, "decode"))
    await engines.answer_announces()
    a = await _start(settings, policy="jsq", replica_id="replica-a", inflight_grace_s=60.0)
    b = await _start(settings, policy="jsq", replica_id="replica-b", inflight_grace_s=60.0)
    try:
        await engines.report()
        await _settle()
        assert a.peers is not None and a.peers.nc is not a.bus.nc and a.peers.nc is not a.ingest.nc
        await a.peers.nc.close()  # what the server does to a slow consumer
        replies = await asyncio.gather(*[_route(bus, f"after{i}") for i in range(20)])
        await asyncio.sleep(0.3)  # let the shared decisions arrive
        assert all(r.engine_id in ids for r in replies)
        counted = {
            name: sum(r.core.fleet.inflight[r.core.fleet.index[e]] for e in ids) for name, r in (("a", a), ("b", b))
        }
        assert counted["b"] == 20  # b still counts a's decisions (a publishes on its serving connection) and its own
        assert 0 < counted["a"] < 20  # a counts only its own now: b's came in on the connection it lost
    finally:
        await a.stop()
        await b.stop()
