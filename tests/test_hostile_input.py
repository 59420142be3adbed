"""Hostile input on every subject: no service crashes or stalls, every request gets an error with a reason,
every rejection is counted.

The router, placement and migration services and a simulated engine's migrate/layout server run in this
process (so their Prometheus counters are readable here) on a real nats-server and a real SQLite file; the
generators are `tests/hostile.py`. Each subject gets every systematic variant of one valid message (wrong
versions, wrong types, bad dimensions, NaN, deep nesting, a payload at the size limit...) and some random
ones. bench/hostile_input.py sends >= 100,000 and measures the services' memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
from nats.errors import MaxPayloadError
from nats.js.errors import BadRequestError

from switchyard.engine_agents.sim.live.migration import MigrationCost, SimExpertGroup, serve_migrate
from switchyard.services.migration.service import run_migration
from switchyard.services.placement import ingest as placement_ingest
from switchyard.services.placement import service as placement_service
from switchyard.services.placement.settings import PlacementSettings
from switchyard.services.refit import read_samples
from switchyard.services.router import metrics as router_metrics
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import REJECTED, Bus
from switchyard.shared.codec import ErrorReply, decode, encode
from switchyard.shared.errors import RemoteError, WireError
from switchyard.shared.schemas import (
    CalibrationRequest,
    ExpertLoad,
    LayoutRequest,
    MigrateRequest,
    RouteDecodeReply,
    RouteDecodeRequest,
    RouteDpRequest,
    RoutingSample,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout
from tests.fleet_helpers import hello, plan
from tests.helpers import eventually
from tests.hostile import over_limit, take

LAYERS, EXPERTS, GPUS = 4, 8, 2
PER_SUBJECT = 260  # every systematic variant of each message, then random ones


@pytest.mark.parametrize("dtype", [",2", "(,)", "<u,2", "i,i", "<u2,", "O", "<U4"])
def test_dtype_strings_numpy_cannot_take_are_refused(dtype: str) -> None:
    """Found by bench/hostile_input.py: a flipped byte made the dtype ',2', and numpy raised SyntaxError."""
    message = RouteDpRequest(request_id="r", prompt_tokens=1)
    obj = {"v": 1, "request_id": "r", "prompt_tokens": 1, "signature": {"dtype": dtype, "shape": [1], "data": b"\0"}}
    payload = msgpack.packb({**obj, "v": RouteDecodeRequest.VERSION}, use_bin_type=True)
    with pytest.raises(WireError):
        decode(payload, RouteDecodeRequest)
    assert decode(encode(message), RouteDpRequest) == message


def _rejected(label: str) -> float:
    """Every rejection of one subscription label, whatever its reason code."""
    total = 0.0
    for metric in REJECTED.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("subscription") == label:
                total += sample.value
    return total


def _counter(counter: object) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))  # type: ignore[attr-defined]


def _valid_messages() -> dict[str, object]:
    now = time.time()
    counts = np.ones((LAYERS, EXPERTS), np.uint16)
    return {
        "hello": hello("e0", "g0", ["g0-gpu0", "g0-gpu1"], layers=LAYERS, experts=EXPERTS, role="decode"),
        "telemetry": Telemetry(
            engine_id="e0",
            seq=1,
            ts=now,
            kv_usage=0.1,
            num_running=1,
            num_waiting=0,
            waiting_prefill_tokens=0,
            remaining_prefill_tokens=0,
            step_time_ema=0.01,
        ),
        "expert_load": ExpertLoad(
            engine_id="e0", ep_group="g0", seq=0, window_start=now - 1, window_end=now, expert_counts=counts
        ),
        "route_decode": RouteDecodeRequest(request_id="r", prompt_tokens=3, signature=counts),
        "route_dp": RouteDpRequest(request_id="r", prompt_tokens=3),
        "plan": plan("g0", 1, default_layout(LAYERS, EXPERTS, GPUS)),
        "calibration_request": CalibrationRequest(request_id="c1", requested_at=now),
        "sample": RoutingSample(
            engine_id="e0",
            request_id="r",
            ts=now,
            prompt_tokens=1,
            decode_tokens=1,
            prefill_counts=counts,
            decode_counts=counts,
        ),
        "migrate": MigrateRequest(plan_id="p", version=1, engine_group="g0", step=0, moves=np.zeros((0, 6), np.int32)),
        "layout": LayoutRequest(engine_group="g0"),
    }


async def _requests(bus: Bus, subject: str, payloads: list[bytes]) -> list[ErrorReply | str]:
    """Send each payload as a request; the decoded ErrorReply of each, or what came back instead."""
    answers: list[ErrorReply | str] = []
    for payload in payloads:
        try:
            msg = await bus.nc.request(subject, payload, timeout=5)
        except Exception as exc:
            answers.append(f"no reply: {type(exc).__name__}")
            continue
        try:
            answers.append(decode(msg.data, ErrorReply))
        except Exception:
            answers.append(f"not an error reply: {msg.data[:80]!r}")
    return answers


async def _stored(bus: Bus, subject: str, payload: bytes) -> bool:
    """Publish to a stream: True if stored, False if the stream refused it as larger than its messages may be
    (`max_msg_size`, issue 29: such a payload never reaches a consumer)."""
    try:
        await bus.js.publish(subject, payload)
    except BadRequestError as exc:
        assert exc.err_code == 10054, exc  # message size exceeds maximum allowed
        info = await bus.js.stream_info(await bus.js.find_stream_name_by_subject(subject))
        assert len(payload) > info.config.max_msg_size
        return False
    return True


@pytest.mark.slow
async def test_hostile_input_on_every_subject(bus: Bus, settings: SwitchyardSettings, tmp_path: Path) -> None:
    settings = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'hostile.db'}"})
    rng = np.random.default_rng(15)
    subjects = bus.subjects
    valid = _valid_messages()
    hostile = {
        name: take(message, np.random.default_rng(rng.integers(2**32)), bus.max_payload, PER_SUBJECT)  # type: ignore[arg-type]
        for name, message in valid.items()
    }
    for name, items in hostile.items():  # the generators themselves: enough of them are refused outright
        assert sum(refused for _, _, refused in items) > PER_SUBJECT * 0.7, name
    refused = {name: [p for _, p, r in items if r] for name, items in hostile.items()}
    accepted = {name: [p for _, p, r in items if not r] for name, items in hostile.items()}

    stop = asyncio.Event()
    await bus.ensure_streams()
    await bus.ensure_kv(subjects.router_bucket)
    router = RouterService(settings, RouterSettings(policy="jsq"))
    await router.start()
    placement = asyncio.create_task(
        placement_service.run_placement(settings, stop, PlacementSettings(tick_s=0.2, warmup_s=0))
    )
    migration = asyncio.create_task(run_migration(settings, stop))
    engine = SimExpertGroup("g0", default_layout(LAYERS, EXPERTS, GPUS), MigrationCost(time_scale=0.0))
    await serve_migrate(bus, "e0", engine)
    services = {"placement": placement, "migration": migration}
    try:
        await asyncio.sleep(2.0)  # both services subscribed
        for name, task in services.items():
            assert not task.done(), f"{name} did not start: {task}"

        # --- pub/sub: counted once per subscription that decodes the subject; learn that from one message ---
        core: dict[str, tuple[str, Callable[[], str]]] = {
            "hello": (subjects.all_hello, lambda: subjects.hello("e0")),  # the engine the payloads name
            "telemetry": (subjects.all_telemetry, lambda: subjects.telemetry("e0")),
        }
        for name, (label, subject) in core.items():
            before = _rejected(label)
            await bus.nc.publish(subject(), b"\xc1")
            await bus.nc.flush()
            per_message = await eventually(lambda label=label, before=before: _delta(label, before), timeout=5)
            before = _rejected(label)
            for payload in refused[name] + accepted[name]:
                await bus.nc.publish(subject(), payload)
            await bus.nc.flush()
            want = per_message * len(refused[name])
            await _until(lambda label=label, before=before, want=want: _rejected(label) - before >= want, 15)
            await asyncio.sleep(0.3)
            assert _rejected(label) - before == want, name  # every refusal counted, once per subscriber

        # --- JetStream subjects: each consumer counts (and terminates) what it cannot decode ---
        streamed = {
            "expert_load": (subjects.all_expert_load, subjects.expert_load("e9")),
            "plan": (subjects.placement_plan, subjects.placement_plan),
            "calibration_request": (subjects.calibration_request, subjects.calibration_request),
        }
        for name, (label, subject) in streamed.items():
            before = _rejected(label)
            want = sum([await _stored(bus, subject, payload) for payload in refused[name]])
            await _until(lambda label=label, before=before, want=want: _rejected(label) - before >= want, 30)
            assert _rejected(label) - before == want, name

        # --- requests: every one answered with an error that names a code and a reason ---
        for name, subject in (
            ("route_decode", subjects.route_decode),
            ("route_dp", subjects.route_dp),
            ("migrate", subjects.migrate("e0")),
            ("layout", subjects.layout("e0")),
        ):
            before = _rejected(subject)
            answers = await _requests(bus, subject, refused[name])
            bad = [a for a in answers if not isinstance(a, ErrorReply) or not (a.error.code and a.error.message)]
            assert not bad, f"{name}: {bad[:3]}"
            assert _rejected(subject) - before == len(refused[name]), name

        # --- routing samples: the refit reader keeps the valid ones and counts the rest ---
        stored = sum([await _stored(bus, subjects.routing_samples, payload) for payload in refused["sample"]])
        await bus.js_publish(subjects.routing_samples, valid["sample"])  # type: ignore[arg-type]
        samples = await read_samples(bus)
        assert (len(samples.samples), samples.rejected) == (1, stored)

        # --- the artifact bucket: a garbage revision is refused and counted, routing goes on ---
        kv = await bus.js.key_value(subjects.router_bucket)
        before = _counter(router_metrics.ARTIFACTS_REFUSED)
        garbage = [p for p in refused["route_decode"][:20] if p]
        for payload in garbage:
            await kv.put(subjects.artifact_key, payload)
        await _until(lambda: _counter(router_metrics.ARTIFACTS_REFUSED) - before >= len(garbage), 10)

        # --- over the size limit: the client refuses to send it at all ---
        with pytest.raises(MaxPayloadError):
            await bus.nc.publish(subjects.hello("e9"), over_limit(bus.max_payload))

        # --- and everything still works ---
        for name, task in services.items():
            assert not task.done(), f"{name} stopped: {task}"
        await bus.publish(subjects.hello("d0"), hello("d0", "d0", ["x"], layers=LAYERS, experts=EXPERTS, role="decode"))
        await bus.publish(subjects.telemetry("d0"), valid["telemetry"].model_copy(update={"engine_id": "d0"}))  # type: ignore[attr-defined]
        await bus.nc.flush()
        reply = await eventually(lambda: _route(bus), timeout=10)
        assert reply.engine_id == "d0"
        windows = _counter(placement_ingest.WINDOWS)
        await bus.js_publish(subjects.expert_load("e0"), valid["expert_load"])  # type: ignore[arg-type]
        await _until(lambda: _counter(placement_ingest.WINDOWS) > windows, 10)
        consumer = await bus.js.consumer_info(subjects.placement_stream, "migration")
        assert consumer.num_ack_pending == 0  # nothing stuck in redelivery
    finally:
        stop.set()
        await router.stop()
        results = await asyncio.gather(*services.values(), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    """Wait until `condition()` holds; fail after `seconds` (a stall)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met: a service stalled or did not count"
        await asyncio.sleep(0.05)


async def _delta(label: str, before: float) -> float:
    await asyncio.sleep(0.05)
    return _rejected(label) - before


async def _route(bus: Bus) -> RouteDecodeReply | None:
    with contextlib.suppress(RemoteError):
        return await bus.request(
            bus.subjects.route_decode, RouteDecodeRequest(request_id="ok", prompt_tokens=1), RouteDecodeReply, 2
        )
    return None
