"""The bus helper against a real nats-server: pub/sub, request/reply, error replies, JetStream, reconnects."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import msgpack
import numpy as np
import pytest
from nats.errors import ConnectionClosedError

from switchyard.shared import schemas as s
from switchyard.shared.bus import HANDLER_ERRORS, Bus, _quiet_callbacks, rejected_count, subject_matches
from switchyard.shared.codec import decode_reply, encode
from switchyard.shared.embedded import EmbeddedNats, find_nats_server, free_port
from switchyard.shared.errors import RemoteError
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Durable
from tests.helpers import telemetry


def _telemetry(seq: int) -> s.Telemetry:
    return telemetry(
        "e1",
        seq,
        ts=1.0,
        kv_usage=0.25,
        num_running=3,
        num_waiting=1,
        waiting_prefill_tokens=100,
        remaining_prefill_tokens=50,
        step_time_ema=0.02,
    )


def test_embedded_server_starts_and_stops(tmp_path) -> None:
    server = EmbeddedNats(tmp_path / "n")
    url = server.start()
    assert server.running and url.startswith("nats://127.0.0.1:")
    pid = server.process.pid
    server.stop()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


async def test_no_echo_connection_does_not_receive_its_own_publishes(bus: Bus, settings: SwitchyardSettings) -> None:
    quiet = await Bus.connect(settings, name="quiet", no_echo=True)
    try:
        got: list[int] = []
        arrived = asyncio.Event()

        def on_telemetry(message: s.Telemetry, _msg: object) -> None:
            got.append(message.seq)
            arrived.set()

        await quiet.subscribe(bus.subjects.all_telemetry, s.Telemetry, on_telemetry)
        await quiet.nc.flush()
        await quiet.publish(bus.subjects.telemetry("e1"), _telemetry(1))  # its own: not delivered back
        # After the PONG, an echo of 1 would already be in quiet's stream, so it would be handled before 2
        await quiet.nc.flush()
        await bus.publish(bus.subjects.telemetry("e1"), _telemetry(2))  # another connection's: delivered
        await bus.nc.flush()
        await asyncio.wait_for(arrived.wait(), 10)  # the evidence, not a fixed sleep (failed under load at 0.1 s)
        assert got == [2]
    finally:
        await quiet.close()


async def test_serve_calls_idle_after_each_burst_and_survives_its_failure(bus: Bus) -> None:
    handled: list[str] = []
    idle_after: list[int] = []

    def handler(request: s.RouteDpRequest) -> s.RouteDpReply:
        handled.append(request.request_id)
        return s.RouteDpReply(request_id=request.request_id, engine_id="e1", priority=1, decision_us=1.0)

    def idle() -> None:
        idle_after.append(len(handled))
        if len(idle_after) == 1:
            raise RuntimeError("the first idle call fails")

    subject = bus.subjects.route_dp
    await bus.serve(subject, s.RouteDpRequest, handler, idle=idle)
    await bus.request(subject, s.RouteDpRequest(request_id="alone", prompt_tokens=1), s.RouteDpReply, timeout=2)
    requests = [s.RouteDpRequest(request_id=f"r{i}", prompt_tokens=1) for i in range(30)]
    replies = await asyncio.gather(*[bus.request(subject, r, s.RouteDpReply, timeout=2) for r in requests])
    assert len(replies) == 30  # still serving after the hook failed
    assert idle_after[0] == 1 and idle_after[-1] == 31 and len(idle_after) <= 31
    await bus.nc.request(subject, b"not msgpack", timeout=2)  # an error reply ends a burst too
    assert idle_after[-1] == 31 and len(idle_after) >= 3


async def test_publish_subscribe_delivers_decoded_messages(bus: Bus) -> None:
    got: list[s.Telemetry] = []
    done = asyncio.Event()

    def on_telemetry(message: s.Telemetry, _msg) -> None:
        got.append(message)
        if len(got) == 3:
            done.set()

    await bus.subscribe(bus.subjects.all_telemetry, s.Telemetry, on_telemetry)
    for seq in range(3):
        await bus.publish(bus.subjects.telemetry("e1"), _telemetry(seq))
    await asyncio.wait_for(done.wait(), 5)
    assert [m.seq for m in got] == [0, 1, 2]
    assert got[0].kv_usage == 0.25


async def test_malformed_publish_is_counted_and_the_subscriber_survives(bus: Bus) -> None:
    got: list[int] = []
    done = asyncio.Event()

    def on_telemetry(message: s.Telemetry, _msg) -> None:
        got.append(message.seq)
        done.set()

    subject = bus.subjects.all_telemetry
    await bus.subscribe(subject, s.Telemetry, on_telemetry)
    before = rejected_count(subject, "not_msgpack")
    await bus.nc.publish(bus.subjects.telemetry("e1"), b"\xc1garbage")
    await bus.publish(bus.subjects.telemetry("e1"), _telemetry(7))
    await asyncio.wait_for(done.wait(), 5)
    assert got == [7]
    assert rejected_count(subject, "not_msgpack") == before + 1


async def test_request_reply_round_trip(bus: Bus) -> None:
    def handler(req: s.RouteDpRequest) -> s.RouteDpReply:
        return s.RouteDpReply(request_id=req.request_id, engine_id="dp3", priority=req.prompt_tokens, decision_us=1.0)

    await bus.serve(bus.subjects.route_dp, s.RouteDpRequest, handler, queue=bus.subjects.router_queue)
    reply = await bus.request(
        bus.subjects.route_dp, s.RouteDpRequest(request_id="q1", prompt_tokens=42), s.RouteDpReply, timeout=2
    )
    assert (reply.request_id, reply.engine_id, reply.priority) == ("q1", "dp3", 42)


async def test_bad_request_gets_an_error_reply_and_a_counter(bus: Bus) -> None:
    calls: list[str] = []

    def handler(req: s.RouteDecodeRequest) -> s.RouteDecodeReply:
        calls.append(req.request_id)
        return s.RouteDecodeReply(request_id=req.request_id, engine_id="d0", policy="rr", band_size=1, decision_us=0.0)

    subject = bus.subjects.route_decode
    await bus.serve(subject, s.RouteDecodeRequest, handler)
    bad = msgpack.packb({"v": 1, "request_id": "r", "prompt_tokens": -5})
    before = rejected_count(subject, "schema")
    msg = await bus.nc.request(subject, bad, timeout=2)
    with pytest.raises(RemoteError) as info:
        decode_reply(msg.data, s.RouteDecodeReply)
    assert info.value.code == "schema" and info.value.field == "prompt_tokens"
    assert rejected_count(subject, "schema") == before + 1
    assert calls == []
    good = await bus.request(subject, s.RouteDecodeRequest(request_id="ok", prompt_tokens=1), s.RouteDecodeReply)
    assert good.request_id == "ok" and calls == ["ok"]


async def test_handler_crash_becomes_internal_error_and_service_continues(bus: Bus) -> None:
    def handler(req: s.RouteDpRequest) -> s.RouteDpReply:
        if req.prompt_tokens == 13:
            raise RuntimeError("unlucky")
        return s.RouteDpReply(request_id=req.request_id, engine_id="dp0", priority=0, decision_us=0.0)

    subject = bus.subjects.route_dp
    await bus.serve(subject, s.RouteDpRequest, handler)
    before = HANDLER_ERRORS.labels(subject)._value.get()
    with pytest.raises(RemoteError) as info:
        await bus.request(subject, s.RouteDpRequest(request_id="a", prompt_tokens=13), s.RouteDpReply)
    assert info.value.code == "internal" and "unlucky" in info.value.message
    assert HANDLER_ERRORS.labels(subject)._value.get() == before + 1
    ok = await bus.request(subject, s.RouteDpRequest(request_id="b", prompt_tokens=1), s.RouteDpReply)
    assert ok.engine_id == "dp0"


async def test_async_handlers_are_awaited(bus: Bus) -> None:
    async def handler(req: s.RouteDpRequest) -> s.RouteDpReply:
        await asyncio.sleep(0.01)
        return s.RouteDpReply(request_id=req.request_id, engine_id="slow", priority=0, decision_us=0.0)

    await bus.serve(bus.subjects.route_dp, s.RouteDpRequest, handler)
    reply = await bus.request(bus.subjects.route_dp, s.RouteDpRequest(request_id="x", prompt_tokens=0), s.RouteDpReply)
    assert reply.engine_id == "slow"


async def test_kv_round_trip_and_idempotent_setup(bus: Bus) -> None:
    bucket = bus.subjects.router_bucket
    kv = await bus.ensure_kv(bucket)
    again = await bus.ensure_kv(bucket)  # second call opens, does not fail
    artifact = s.RoutingArtifact(
        version=3,
        content_hash="ab" * 8,
        created_at=1.0,
        model=s.ModelShape(name="m", num_layers=4, num_experts=8, top_k=2),
        representation="count_idf",
        layer_mask=[1, 3],
        idf=np.full((2, 8), 0.5, np.float32),
        centroids=np.eye(4, 16, dtype=np.float32),
        rho=0.61,
    )
    revision = await kv.put(bus.subjects.artifact_key, encode(artifact))
    entry = await again.get(bus.subjects.artifact_key)
    assert entry.revision == revision
    restored = decode_reply(entry.value, s.RoutingArtifact)
    assert restored.version == 3 and restored.layer_mask == [1, 3]
    np.testing.assert_array_equal(restored.centroids, artifact.centroids)


async def test_streams_are_created_idempotently_and_persist_messages(bus: Bus) -> None:
    await bus.ensure_streams()
    await bus.ensure_streams()
    names = {info.config.name for info in await bus.js.streams_info()}
    assert set(bus.subjects.streams()) <= names
    load = s.ExpertLoad(
        engine_id="e1",
        ep_group="g0",
        seq=0,
        window_start=0.0,
        window_end=1.0,
        expert_counts=np.arange(8, dtype=np.uint32).reshape(2, 4),
    )
    seq = await bus.js_publish(bus.subjects.expert_load("e1"), load, msg_id="e1-0")
    dup = await bus.js_publish(bus.subjects.expert_load("e1"), load, msg_id="e1-0")
    assert dup == seq  # de-duplicated by message id
    stored = await bus.js.get_msg(bus.subjects.expert_load_stream, seq)
    assert decode_reply(stored.data, s.ExpertLoad).expert_counts.sum() == 28


async def test_first_connection_retries_until_the_server_appears(tmp_path, settings: SwitchyardSettings) -> None:
    port = free_port()
    server = EmbeddedNats(tmp_path / "late", port=port)
    late = settings.model_copy(update={"nats_servers": [f"nats://127.0.0.1:{port}"], "nats_initial_connect_s": 10.0})
    connecting = asyncio.create_task(Bus.connect(late, name="early-bird"))
    await asyncio.sleep(0.8)
    assert not connecting.done()
    await asyncio.to_thread(server.start)
    try:
        bus = await asyncio.wait_for(connecting, 10)
        assert bus.nc.is_connected
        await bus.close()
    finally:
        server.stop()


async def test_unreachable_server_fails_with_a_clear_error(settings: SwitchyardSettings) -> None:
    gone = settings.model_copy(
        update={"nats_servers": [f"nats://127.0.0.1:{free_port()}"], "nats_initial_connect_s": 0.5}
    )
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await Bus.connect(gone)


async def test_publishes_survive_a_server_restart(tmp_path, settings: SwitchyardSettings) -> None:
    server = EmbeddedNats(tmp_path / "restart", port=free_port())
    server.start()
    cfg = settings.model_copy(update={"nats_servers": [server.url]})
    subscriber, publisher = await Bus.connect(cfg), await Bus.connect(cfg)
    try:
        got: list[int] = []
        await subscriber.subscribe(subscriber.subjects.all_telemetry, s.Telemetry, lambda m, _: got.append(m.seq))
        await subscriber.nc.flush()
        server.stop()
        await asyncio.sleep(0.3)
        server.start()
        for _ in range(100):  # both clients reconnect on their own
            if subscriber.nc.is_connected and publisher.nc.is_connected:
                break
            await asyncio.sleep(0.1)
        await publisher.publish(publisher.subjects.telemetry("e1"), _telemetry(99))
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.1)
        assert got == [99]
    finally:
        await subscriber.close()
        await publisher.close()
        server.stop()


async def test_encoded_payloads_are_small(bus: Bus) -> None:
    sig = np.zeros((48, 128), np.uint16)
    size = len(encode(s.RouteDecodeRequest(request_id="r" * 36, prompt_tokens=1000, signature=sig)))
    assert 12 * 1024 < size < 12 * 1024 + 200  # the seed's 12 KiB signature plus a few header bytes


async def test_durable_pull_follows_the_settings_in_the_code(bus: Bus) -> None:
    """A durable consumer created by an older release gets the current settings, not silently the old ones."""
    await bus.ensure_streams()
    stream, subject = bus.subjects.placement_stream, bus.subjects.placement_plan
    durable = Durable("admin", stream, "durable-test", subject)
    first = await bus.durable_pull(durable, ack_wait=5.0, max_deliver=2)
    await first.unsubscribe()
    second = await bus.durable_pull(durable, ack_wait=7.0, max_deliver=4)
    info = await bus.js.consumer_info(stream, "durable-test")
    assert (info.config.ack_wait, info.config.max_deliver, info.config.filter_subject) == (7.0, 4, subject)
    await bus.js.publish(subject, b"x")
    assert [m.data for m in await second.fetch(1, timeout=2)] == [b"x"]
    # unchanged settings are left alone; a rewritten filter is found and set back
    assert not await bus.ensure_durable(durable, ack_wait=7.0, max_deliver=4)
    await bus.js.add_consumer(
        stream,
        durable_name="durable-test",
        filter_subject=bus.subjects.calibration_request,
        ack_policy="explicit",
        ack_wait=7.0,
        max_deliver=4,
    )
    assert await bus.ensure_durable(durable, ack_wait=7.0, max_deliver=4)
    assert (await bus.js.consumer_info(stream, "durable-test")).config.filter_subject == subject
    await second.unsubscribe()


def test_the_shipped_nats_server_config_is_valid_and_allows_our_payloads() -> None:
    config = Path(__file__).parents[1] / "infra" / "nats" / "nats-server.conf"
    from switchyard.shared.nats_auth import password_variable

    text = config.read_text()
    users = re.findall(r'user: "([^"]+)"', text)
    env = {**os.environ, **{password_variable(u): "pw-" + u for u in users}}  # the passwords come from here
    checked = subprocess.run(
        [str(find_nats_server()), "-c", str(config), "-t"], capture_output=True, text=True, env=env
    )
    assert checked.returncode == 0, checked.stderr
    assert "max_payload: 8MB" in text  # == SwitchyardSettings().max_payload_bytes
    assert re.search(r"^listen: 127\.0\.0\.1:4222", text, re.M) and re.search(r"^authorization \{", text, re.M)
    assert SwitchyardSettings().max_payload_bytes == 8 * 1024 * 1024


async def test_small_message_classes_have_their_own_size_limit(bus: Bus) -> None:
    """Finding 3: payloads near 8 MiB on `sy.engine.*.telemetry` were accepted up to the server's limit; a
    telemetry message is ~200 bytes, so its class is refused beyond 16 KiB, before it is unpacked."""
    got: list[int] = []
    await bus.subscribe(bus.subjects.all_telemetry, s.Telemetry, lambda m, _: got.append(m.seq))
    await bus.nc.flush()
    before = rejected_count(bus.subjects.all_telemetry, "too_large")
    padded = msgpack.packb({**msgpack.unpackb(encode(_telemetry(1))), "padding": "x" * 64 * 1024})
    await bus.nc.publish(bus.subjects.telemetry("e1"), padded)  # valid apart from its size
    await bus.publish(bus.subjects.telemetry("e1"), _telemetry(2))
    await bus.nc.flush()
    for _ in range(40):
        if got:
            break
        await asyncio.sleep(0.05)
    assert got == [2] and rejected_count(bus.subjects.all_telemetry, "too_large") == before + 1
    assert bus.max_payload // 100 > s.Telemetry.MAX_WIRE_BYTES


async def test_a_handler_failing_on_every_message_does_not_flood_the_log(bus: Bus, caplog) -> None:
    """Finding 9: logs grew ~150 MB in minutes under hostile input. Every failure is counted; tracebacks are
    logged at most once per second per subscription, with a count of those held back."""

    def handler(_message: s.Telemetry, _msg: object) -> None:
        raise RuntimeError("this handler always fails")

    subject = bus.subjects.all_telemetry
    await bus.subscribe(subject, s.Telemetry, handler)
    await bus.nc.flush()
    before = HANDLER_ERRORS.labels(subject)._value.get()
    with caplog.at_level("ERROR", logger="switchyard.shared.bus"):
        for i in range(200):
            await bus.publish(bus.subjects.telemetry("e1"), _telemetry(i))
        await bus.nc.flush()
        for _ in range(100):
            if HANDLER_ERRORS.labels(subject)._value.get() == before + 200:
                break
            await asyncio.sleep(0.05)
    assert HANDLER_ERRORS.labels(subject)._value.get() == before + 200
    logged = [r for r in caplog.records if "handler for" in r.getMessage()]
    assert 1 <= len(logged) < 20


async def test_errors_while_we_close_the_connection_ourselves_are_not_warnings(caplog) -> None:
    """nats-py reports "connection closed" to whatever still uses a connection being drained (an ordered
    consumer's heartbeat, at every `make run` stop); that is our own doing, not a fault."""
    closing = [False]
    on_error = _quiet_callbacks("svc", closing)["error_cb"]
    with caplog.at_level("DEBUG", logger="switchyard.shared.bus"):
        await on_error(ConnectionClosedError())
        closing[0] = True
        await on_error(ConnectionClosedError())
    levels = [r.levelname for r in caplog.records if "svc: NATS error" in r.getMessage()]
    assert levels == ["WARNING", "DEBUG"]


async def test_stored_bytes_relayed_by_a_jetstream_consumer_are_refused(bus: Bus) -> None:
    """Whoever may create a push consumer picks its deliver subject, and nats-server delivers the stream's
    messages there (keeping their stored subject) whatever the creator may publish: bytes an engine stored as
    a routing sample arrived on e1's hello subject as a hello in e1's name, and on a served subject as a
    request. Subscriptions now refuse (and count) a message whose subject is not theirs (a delivery keeps the
    subject it was stored under)."""
    from tests.fleet_helpers import hello
    from tests.helpers import eventually

    await bus.ensure_streams()
    subjects = bus.subjects
    forged = hello("e1", "g-forged", ["forged-gpu"], role="decode")
    await bus.js.publish(subjects.routing_samples, encode(forged))  # what any engine may store
    seen: list[str] = []
    served: list[s.Announce] = []
    await bus.subscribe(subjects.all_hello, s.Hello, lambda m, _: seen.append(m.engine_id))
    await bus.serve(subjects.route_dp, s.Announce, lambda m: served.append(m) or m)
    # a push consumer delivers only while its deliver subject itself has a subscriber (wildcards do not count):
    # whoever may read hellos can make one (the attacker, as `readonly`), and then the wildcards get it too
    exact = await bus.nc.subscribe(subjects.hello("e1"))
    await bus.nc.flush()
    hellos, requests = (rejected_count(x, "relayed") for x in (subjects.all_hello, subjects.route_dp))
    for target in (subjects.hello("e1"), subjects.route_dp):  # ack none: the delivery still has a reply subject
        await bus.js.add_consumer(
            subjects.routing_samples_stream, deliver_subject=target, ack_policy="none", deliver_policy="last"
        )
    await bus.publish(subjects.hello("e0"), hello("e0", "g0", ["gpu0"]))  # positive control: a real hello

    async def settled() -> bool:
        counts = (rejected_count(subjects.all_hello, "relayed"), rejected_count(subjects.route_dp, "relayed"))
        return "e0" in seen and counts == (hellos + 1, requests + 1)

    await eventually(settled, timeout=30)
    assert seen == ["e0"] and served == []
    await exact.unsubscribe()


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("sy.engine.*.hello", "sy.engine.e1.hello", True),
        ("sy.engine.*.hello", "sy.routing.samples", False),
        ("sy.engine.*.hello", "sy.engine.e1.hello.x", False),
        ("sy.sim.>", "sy.sim.submit.p0", True),
        ("sy.sim.>", "sy.sim", False),
        ("sy.route.dp", "sy.route.dp", True),
        ("sy.route.dp", "sy.route.decode", False),
    ],
)
def test_subject_matching_follows_nats(pattern: str, subject: str, matches: bool) -> None:
    """What a subscription may receive (anything else is a relayed delivery): `*` one token, `>` the rest."""
    assert subject_matches(pattern, subject) is matches
