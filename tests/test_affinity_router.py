"""Issue 40 item 3 in the live router: expert-affinity dispatch fed by the engines' prefill signatures.

A router with the `gimbal-affinity` DP profile on a real nats-server; two DP engines (test-side, on their own
subjects) say hello, report telemetry and publish `PrefillSignature` on ``sy.engine.<id>.signature`` for the
requests the router sent them. What must hold: after e1 publishes a signature for a prompt, a request sharing
that prompt's prefix goes to e1 at equal pressure (where pressure alone picks e0), and with the weight 0 it does
not; an engine's signature counts only for a request sent to it, once; everything the engines feed is bounded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from switchyard.services.router.affinity import AffinityLimits, AffinityState
from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode
from switchyard.shared.prefix_keys import block_keys
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.routing.affinity import SignatureCache
from tests.gateway_helpers import wait_for
from tests.test_prefix_router import BLOCK, Fleet, start_fleet

# Two prompts with nothing in common, and a third that starts with the second's 32 blocks
PROMPT_A = np.arange(512) % 5000 + 7
PROMPT_B = np.arange(512) % 5000 + 20_000
PROMPT_B2 = np.concatenate([PROMPT_B, np.arange(256) + 40_000])
# The toy model's [2 layers, 4 experts] prefill counts: A's requests use experts 0-1, B's experts 2-3
SIG_A = np.array([[9, 9, 0, 0], [9, 9, 0, 0]], dtype=np.int64)
SIG_B = np.array([[0, 0, 9, 9], [0, 0, 9, 9]], dtype=np.int64)


def affinity_settings(**extra: object) -> RouterSettings:
    return RouterSettings(dp_profile="gimbal-affinity", inflight_grace_s=0.0, fresh_load_s=5.0, **extra)  # type: ignore[arg-type]


@pytest.fixture
async def fleet(bus: Bus, settings: SwitchyardSettings, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    started = await start_fleet(bus, settings, affinity_settings(**getattr(request, "param", {})))
    try:
        yield started
    finally:
        await started.router.stop()


async def route(bus: Bus, request_id: str, prompt: np.ndarray) -> str:
    keys = block_keys(prompt, BLOCK)
    request = s.RouteDpRequest(request_id=request_id, prompt_tokens=len(prompt), block_keys=keys)
    reply = await bus.request(bus.subjects.route_dp, request, s.RouteDpReply, timeout=5)
    return reply.engine_id


async def publish_signature(
    bus: Bus, engine_id: str, request_id: str, signature: np.ndarray, claimed: str | None = None
) -> None:
    """`engine_id` publishes on its own subject a signature for `request_id` (claiming to be `claimed`)."""
    message = s.PrefillSignature(
        engine_id=claimed or engine_id, request_id=request_id, ts=time.time(), prompt_tokens=512, signature=signature
    )
    await bus.nc.publish(bus.subjects.signature(engine_id), encode(message))
    await bus.nc.flush()


def counted(core: RouterCore, outcome: str) -> int:
    assert core.affinity is not None
    return core.affinity.counts[outcome]


async def learn(fleet: Fleet, bus: Bus) -> None:
    """Request a (prompt A) goes to e0, b (prompt B) to e1 (e0 has a in flight); each engine publishes the
    signature of its own request; then both report, so pressure is equal again."""
    assert await route(bus, "a", PROMPT_A) == "e0"
    assert await route(bus, "b", PROMPT_B) == "e1"
    await publish_signature(bus, "e0", "a", SIG_A)
    await publish_signature(bus, "e1", "b", SIG_B)
    if fleet.core.affinity is not None:
        await wait_for(lambda: counted(fleet.core, "used") == 2)
    await fleet.settle()


async def test_a_request_sharing_a_prefix_goes_where_its_experts_went(fleet: Fleet, bus: Bus) -> None:
    await learn(fleet, bus)
    assert await route(bus, "c", PROMPT_B2) == "e1"  # pressure alone: e0 (equal, first minimum)
    await fleet.settle()
    assert await route(bus, "d", PROMPT_A) == "e0"
    await fleet.settle()
    # no prefix the cache holds: pressure alone
    assert await route(bus, "e", np.arange(300) + 90_000) == "e0"


@pytest.mark.parametrize("fleet", [{"affinity_weight": 0.0}], indirect=True)
async def test_with_weight_zero_the_signatures_change_nothing(fleet: Fleet, bus: Bus) -> None:
    await learn(fleet, bus)
    assert fleet.core.affinity is None  # the term is gone from the profile: nothing reads the signatures
    assert await route(bus, "c", PROMPT_B2) == "e0"


async def test_an_engine_speaks_only_for_its_own_requests_once(fleet: Fleet, bus: Bus) -> None:
    assert await route(bus, "a", PROMPT_A) == "e0"
    assert await route(bus, "b", PROMPT_B) == "e1"
    # e0 describes e1's request (on its own subject, or claiming e1's id): not believed, and e1 still may
    await publish_signature(bus, "e0", "b", SIG_A)
    await publish_signature(bus, "e0", "b", SIG_A, claimed="e1")
    await publish_signature(bus, "e0", "nobody-routed-this", SIG_A)
    await wait_for(lambda: counted(fleet.core, "not_routed") >= 1)
    assert counted(fleet.core, "used") == 0
    await publish_signature(bus, "e1", "b", SIG_B)
    await publish_signature(bus, "e1", "b", SIG_A)  # a second one for the same request: not routed any more
    await wait_for(lambda: counted(fleet.core, "not_routed") >= 2)
    affinity = fleet.core.affinity
    assert affinity is not None and counted(fleet.core, "used") == 1
    now = time.monotonic()
    assert affinity.traffic_mass("e0", now) == 0.0 and affinity.traffic_mass("e1", now) > 0
    assert counted(fleet.core, "other_engine") >= 1


def test_the_gateways_id_inside_an_engines_request_id_matches() -> None:
    state = AffinityState(AffinityLimits())
    routed = "sygw-" + "0123456789abcdef" * 2
    state.routed(routed, "e0", block_keys(PROMPT_A, BLOCK), 0.0)
    vllm_id = f"cmpl-{routed}-0"
    message = s.PrefillSignature(engine_id="e0", request_id=vllm_id, ts=0.0, prompt_tokens=1, signature=SIG_A)
    assert state.on_signature(message, "e0", 1.0) == "used"
    assert state.predict(block_keys(PROMPT_A, BLOCK), ["e0", "e1"], 1.0) is None  # one engine with traffic: none
    assert len(state.cache) == len(block_keys(PROMPT_A, BLOCK))


def test_what_engines_feed_is_bounded() -> None:
    state = AffinityState(AffinityLimits(pending=2, pending_ttl_s=10.0, max_features=4))
    for n, at in ((0, 0.0), (1, 0.0), (2, 0.0)):
        state.routed(f"r{n}", "e0", None, at)
    assert state.pending == 2  # r0 fell out
    message = s.PrefillSignature(engine_id="e0", request_id="r0", ts=0.0, prompt_tokens=1, signature=SIG_A)
    assert state.on_signature(message, "e0", 0.0) == "not_routed"
    assert state.on_signature(message.model_copy(update={"request_id": "r1"}), "e0", 0.0) == "shape"  # 8 > 4
    state.routed("r3", "e0", None, 20.0)  # r1 and r2 are older than the 10 s they are kept
    assert state.pending == 1
    state.forget({"e1"})
    # the cache: keys and the bytes of the distinct signatures they point at
    cache = SignatureCache(max_keys=100, max_bytes=3 * 64)
    vectors = [np.full(8, float(i)) for i in range(5)]  # 64 bytes each
    for i, v in enumerate(vectors):
        cache.record([10 * i, 10 * i + 1], v)  # two keys share one vector
    assert cache.nbytes <= 3 * 64 and len(cache) == 6
    assert cache.predict([0, 1]) is None and cache.predict([40, 41]) is not None
