"""Issue 25, the router's side of prefix routing, over a real nats-server.

Engines (test-side, speaking the real protocol on their own subjects) announce with a block size, report
telemetry, and publish `KvEvents` on `sy.engine.<id>.kv`; a router with the `switchyard` DP profile answers
`sy.route.dp` requests carrying a prompt's block keys. What must hold: the engine holding the prompt's blocks
takes it at equal pressure, and stops attracting it once it reports its cache cleared (or its event stream
has a gap); an engine that never sends events still takes traffic by pressure; the approximate index (and
text keys, whatever the mode) follows the router's own decisions. The liveness and restart rules are checked
on the core with a clock of the test's own.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

import httpx
import msgpack
import nats
import numpy as np
import pytest

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.router.ask import LocalDpAsk
from switchyard.services.router.core import RouterCore
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import DEFAULT_PREFIX_INDEX, RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus, rejected_count
from switchyard.shared.codec import encode
from switchyard.shared.engine_manifest import EngineEntry, EngineManifest
from switchyard.shared.prefix_keys import block_keys, text_keys
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects
from switchyard.solver.routing.profiles import PREFIX_WEIGHT
from tests.gateway_helpers import deployment, metric, wait_for
from tests.helpers import telemetry

BLOCK = 16
PROMPT = np.arange(1024) % 5000 + 7  # a 1024-token prompt: 64 blocks of 16
KEYS = block_keys(PROMPT, BLOCK)


class FakeEngine:
    """One DP engine on a raw connection: hello, telemetry and KV events, each numbered as an engine does."""

    def __init__(self, nc: nats.NATS, subjects: Subjects, engine_id: str, block_size: int = BLOCK) -> None:
        self.nc, self.subjects, self.engine_id, self.block_size = nc, subjects, engine_id, block_size
        self._telemetry = itertools.count()
        self.kv_seq = 0

    async def hello(self, block_size: int | None = None) -> None:
        hello = s.Hello(
            engine_id=self.engine_id,
            role="dp",
            model=s.ModelShape(name="toy", num_layers=2, num_experts=4, top_k=1),
            ep_group=self.engine_id,
            gpus=["0"],
            capacity=s.Capacity(max_running=64, kv_blocks=4096, block_size=block_size or self.block_size),
            ts=time.time(),
            agent="sim",
        )
        await self.nc.publish(self.subjects.hello(self.engine_id), encode(hello))
        await self.nc.flush()

    async def report(self, waiting_prefill: int = 0) -> None:
        telemetry = s.Telemetry(
            engine_id=self.engine_id,
            seq=next(self._telemetry),
            ts=time.time(),
            kv_usage=0.1,
            num_running=0,
            num_waiting=0,
            waiting_prefill_tokens=waiting_prefill,
            remaining_prefill_tokens=0,
            step_time_ema=0.01,
        )
        await self.nc.publish(self.subjects.telemetry(self.engine_id), encode(telemetry))
        await self.nc.flush()

    def events(self, *ops: tuple[str, np.ndarray], seq: int | None = None, **fields: object) -> s.KvEvents:
        """The next `KvEvents` message (or one with `seq` and other fields as given)."""
        if seq is None:
            seq, self.kv_seq = self.kv_seq, self.kv_seq + 1
        message = {
            "engine_id": self.engine_id,
            "seq": seq,
            "ts": time.time(),
            "block_size": self.block_size,
            "ops": [s.KvOp(kind=kind, keys=np.asarray(keys, dtype=np.uint64)) for kind, keys in ops],  # type: ignore[arg-type]
        }
        return s.KvEvents(**{**message, **fields})  # type: ignore[arg-type]

    async def kv(self, *ops: tuple[str, np.ndarray], seq: int | None = None, subject: str | None = None, **fields):
        payload = encode(self.events(*ops, seq=seq, **fields))
        await self.nc.publish(subject or self.subjects.kv_events(self.engine_id), payload)
        await self.nc.flush()


NONE = np.zeros(0, dtype=np.uint64)


def stored(keys: np.ndarray) -> tuple[str, np.ndarray]:
    return ("stored", keys)


def cleared() -> tuple[str, np.ndarray]:
    return ("cleared", NONE)


async def route(bus: Bus, keys: np.ndarray | None = KEYS, kind: str = "tokens", prompt: int = len(PROMPT)) -> str:
    request = s.RouteDpRequest(request_id="r", prompt_tokens=prompt, block_keys=keys, key_kind=kind)  # type: ignore[arg-type]
    reply = await bus.request(bus.subjects.route_dp, request, s.RouteDpReply, timeout=5)
    return reply.engine_id


def router_settings(**extra: object) -> RouterSettings:
    # stale after 5 s: a loaded test machine can hold telemetry back; no test here relies on staleness
    return RouterSettings(dp_profile="switchyard", inflight_grace_s=0.0, fresh_load_s=5.0, **extra)  # type: ignore[arg-type]


class Fleet:
    """A router and engines e0, e1 on one connection of the test's; `settle` reports and waits for the router."""

    def __init__(self, router: RouterService, engines: dict[str, FakeEngine]) -> None:
        self.router, self.engines = router, engines

    @property
    def core(self) -> RouterCore:
        return self.router.core

    def blocks(self, engine_id: str) -> int:
        return self.core.prefix.blocks.blocks(engine_id)

    async def settle(self, **waiting_prefill: int) -> None:
        """Every engine reports (its `waiting_prefill` as given, else 0); returns once the router has it all,
        so decisions made before count no more (in-flight grace 0)."""
        fleet = self.core.fleet
        marks = {e: int(fleet.last_seq[fleet.index[e]]) for e in self.engines}
        for engine_id, engine in self.engines.items():
            await engine.report(waiting_prefill.get(engine_id, 0))
        await wait_for(lambda: all(int(fleet.last_seq[fleet.index[e]]) > marks[e] for e in self.engines))

    async def until(self, condition: Callable[[], bool]) -> None:
        await wait_for(condition)


async def start_fleet(bus: Bus, settings: SwitchyardSettings, router: RouterSettings) -> Fleet:
    service = RouterService(settings, router)
    await service.start()
    engines = {e: FakeEngine(bus.nc, bus.subjects, e) for e in ("e0", "e1")}
    for engine in engines.values():
        await engine.hello()
        await engine.report()
    fleet = service.core.fleet
    await wait_for(lambda: all(e in fleet.index and fleet.role[fleet.index[e]] >= 0 for e in engines))
    await wait_for(lambda: all(fleet.last_seq[fleet.index[e]] >= 0 for e in engines))
    return Fleet(service, engines)


@pytest.fixture
async def fleet(bus: Bus, settings: SwitchyardSettings, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    extra = getattr(request, "param", {})
    started = await start_fleet(bus, settings, router_settings(**extra))
    try:
        yield started
    finally:
        await started.router.stop()


def test_the_default_dp_profile_is_the_composed_one() -> None:
    assert RouterSettings().dp_rule == "switchyard" and RouterSettings().build_dp_profile().name == "switchyard"


def test_the_default_index_is_one_constant() -> None:
    assert RouterSettings().prefix_index == DEFAULT_PREFIX_INDEX == "precise"


async def test_the_engine_holding_the_prefix_takes_it_until_it_clears(fleet: Fleet, bus: Bus) -> None:
    """(a) Equal telemetry: without keys the first engine (e0) wins the tie; e1's stored blocks draw the keyed
    request; once e1 reports its cache cleared, the choice is by pressure again (e0)."""
    e1 = fleet.engines["e1"]
    assert await route(bus, None) == "e0"  # control: by pressure alone
    await fleet.settle()
    await e1.kv(stored(KEYS))
    await fleet.until(lambda: fleet.blocks("e1") == len(KEYS))
    assert await route(bus) == "e1"
    await fleet.settle()
    assert await route(bus, KEYS[:10]) == "e1"  # a shorter prompt sharing the prefix too
    await fleet.settle()
    await e1.kv(cleared())
    await fleet.until(lambda: fleet.blocks("e1") == 0)
    assert await route(bus) == "e0"
    assert metric("switchyard_router_kv_events_total", op="stored") >= len(KEYS)


async def test_a_partial_prefix_weighs_against_pressure(fleet: Fleet, bus: Bus) -> None:
    """e1 holds the first half (512 tokens): it wins over an idle e0 while its queue is shorter than what the
    cache saves (512 tokens at the prefix weight), and loses once its queue holds more."""
    e1 = fleet.engines["e1"]
    await e1.kv(stored(KEYS[:32]))
    await fleet.until(lambda: fleet.blocks("e1") == 32)
    saved = 512 * PREFIX_WEIGHT
    await fleet.settle(e1=int(0.8 * saved))
    assert await route(bus) == "e1"
    await fleet.settle(e1=int(1.2 * saved))
    assert await route(bus) == "e0"


async def test_an_engine_without_events_gets_traffic_by_pressure(fleet: Fleet, bus: Bus) -> None:
    """(b) e0 never sends KV events: it takes keyed requests when e1, holding the prefix, is loaded past it."""
    e1 = fleet.engines["e1"]
    await e1.kv(stored(KEYS))
    await fleet.until(lambda: fleet.blocks("e1") == len(KEYS))
    busy = int(2 * len(PROMPT) * PREFIX_WEIGHT)  # more queued prefill than the whole prompt's cache saves
    await fleet.settle(e1=busy)
    assert await route(bus) == "e0"
    await fleet.settle(e1=busy)
    assert await route(bus, None) == "e0"
    await fleet.settle(e0=busy)
    assert await route(bus) == "e1"


async def test_a_sequence_gap_or_step_back_clears_the_engine(fleet: Fleet, bus: Bus) -> None:
    """(d) Events lost (a gap) or a restarted numbering: the engine's blocks are unknown, so they are dropped;
    what the message itself stores is kept."""
    e1 = fleet.engines["e1"]
    other = block_keys(np.arange(160) + 90_000, BLOCK)  # 10 unrelated blocks
    await e1.kv(stored(KEYS), seq=0)
    await fleet.until(lambda: fleet.blocks("e1") == len(KEYS))
    await e1.kv(stored(other), seq=2)  # seq 1 was lost
    await fleet.until(lambda: fleet.blocks("e1") == len(other))
    assert metric("switchyard_router_kv_resets_total", reason="seq_gap") >= 1
    assert await route(bus) == "e0"
    await fleet.settle()
    await e1.kv(stored(KEYS), seq=3)
    await fleet.until(lambda: fleet.blocks("e1") == len(other) + len(KEYS))
    await e1.kv(stored(other[:2]), seq=0)  # a new process numbering from 0
    await fleet.until(lambda: fleet.blocks("e1") == 2)
    assert metric("switchyard_router_kv_resets_total", reason="seq_back") >= 1
    assert await route(bus) == "e0"


@pytest.mark.parametrize("fleet", [{"prefix_index": "approximate"}], indirect=True)
async def test_the_approximate_index_follows_the_routers_own_decisions(fleet: Fleet, bus: Bus) -> None:
    """No engine sends events: the first keyed request goes to e0 (tie), and the same prefix follows it there
    even when e0 is a little busier; KV events are not read in this mode."""
    assert await route(bus) == "e0"
    await fleet.settle(e0=300)
    assert await route(bus) == "e0"
    assert fleet.core.prefix.routed.blocks("e0") == len(KEYS)
    assert not fleet.core.ingests_kv


async def test_text_keys_are_matched_against_what_was_routed(fleet: Fleet, bus: Bus) -> None:
    """Precise mode, but keys over the prompt's text (no tokenizer at the gateway): no engine reports those, so
    the router's own decisions are the index, and a matched block counts as the prompt's tokens per key."""
    keys = text_keys("You are a helpful assistant. " * 40, 64)
    assert await route(bus, keys, "text", prompt=300) == "e0"
    await fleet.settle(e0=200)
    assert await route(bus, keys, "text", prompt=300) == "e0"
    await fleet.settle(e0=int(2 * 300 * PREFIX_WEIGHT))  # more queued than the whole prompt saves: pressure wins
    assert await route(bus, keys, "text", prompt=300) == "e1"
    assert fleet.blocks("e0") == 0  # the precise index holds only what engines reported


async def test_a_profile_without_cached_tokens_reads_no_index(bus: Bus, settings: SwitchyardSettings) -> None:
    """Gimbal ignores the keys: no KV subscription, no query built from them."""
    router = RouterSettings(dp_profile="gimbal", inflight_grace_s=0.0, fresh_load_s=5.0)
    started = await start_fleet(bus, settings, router)
    try:
        assert not started.core.ingests_kv
        await started.engines["e1"].kv(stored(KEYS))
        await asyncio.sleep(0.2)
        assert started.blocks("e1") == 0
        assert await route(bus) == "e0"
    finally:
        await started.router.stop()


# ----- the core's rules, on the test's clock -----


def _core(**extra: object) -> RouterCore:
    return RouterCore(router_settings(**extra))


def _hello(engine_id: str, block_size: int = BLOCK) -> s.Hello:
    return s.Hello(
        engine_id=engine_id,
        role="dp",
        model=s.ModelShape(name="toy", num_layers=2, num_experts=4, top_k=1),
        ep_group=engine_id,
        gpus=["0"],
        capacity=s.Capacity(max_running=64, kv_blocks=4096, block_size=block_size),
        ts=0.0,
        agent="sim",
    )


def _events(engine_id: str, seq: int, keys: np.ndarray = KEYS, block_size: int = BLOCK) -> s.KvEvents:
    op = s.KvOp(kind="stored", keys=keys)
    return s.KvEvents(engine_id=engine_id, seq=seq, ts=0.0, block_size=block_size, ops=[op])


def test_a_dead_engine_is_forgotten_and_a_restarted_one_starts_empty() -> None:
    core = _core()
    for engine_id in ("e0", "e1"):
        core.on_hello(_hello(engine_id), 0.0)
        core.on_telemetry(telemetry(engine_id, 100), 0.0)
    assert core.on_kv(_events("e0", 0), 0.0) is None and core.on_kv(_events("e1", 0), 0.0) is None
    # e1 restarts: its telemetry numbers from 0 again (a new process, an empty cache)
    core.on_telemetry(telemetry("e1", 0), 1.0)
    assert core.prefix.blocks.blocks("e1") == 0 and core.prefix.blocks.blocks("e0") == len(KEYS)
    # e0 goes silent: dead by the liveness rule (3 × 0.1 s of telemetry, 3 × 5 s of hello) and forgotten
    core.on_hello(_hello("e1"), 20.0)
    core.on_telemetry(telemetry("e1", 1), 20.0)
    core.housekeeping(20.0)
    assert core.prefix.blocks.blocks("e0") == 0 and "e0" not in core.prefix.engines()
    assert core.on_kv(_events("e0", 1), 20.0) == "unknown_engine"  # dead: refused until it says hello again
    assert core.on_kv(_events("e1", 1), 20.0) is None


def test_a_hello_changing_the_block_size_drops_the_engines_blocks() -> None:
    core = _core()
    core.on_hello(_hello("e0"), 0.0)
    core.on_telemetry(telemetry("e0", 0), 0.0)
    assert core.on_kv(_events("e0", 0), 0.0) is None
    core.on_hello(_hello("e0", block_size=32), 0.1)
    assert core.prefix.blocks.blocks("e0") == 0
    assert core.on_kv(_events("e0", 1), 0.1) == "block_size"
    assert core.on_kv(_events("e0", 2, block_size=32), 0.1) is None


def test_indexed_blocks_is_gathered_from_the_index_in_use() -> None:
    for mode in ("precise", "approximate"):
        core = _core(prefix_index=mode)
        for engine_id in ("e0", "e1"):
            core.on_hello(_hello(engine_id), 0.0)
            core.on_telemetry(telemetry(engine_id, 0), 0.0)
        if mode == "precise":
            core.on_kv(_events("e1", 0, KEYS[:5]), 0.0)
        else:
            request = s.RouteDpRequest(request_id="r", prompt_tokens=80, block_keys=KEYS[:5])
            core.prefix.record("e1", request, 0.0)
        core.dp.prepare(0.0, 5.0, ())
        core.fleet.touch()
        core.dp.gather(("indexed_blocks",))
        assert core.dp.snap.columns["indexed_blocks"].tolist() == [0.0, 5.0], mode


async def test_the_switchyard_profile_serves_end_to_end(
    bus: Bus, settings: SwitchyardSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SWITCHYARD_ROUTER_DP_PROFILE=switchyard`: a gateway, the router and two stub DP engines (which send no KV
    events) serve client requests, by pressure, and the router counts its decisions under that profile."""
    monkeypatch.setenv("SWITCHYARD_ROUTER_DP_PROFILE", "switchyard")
    router = RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0)
    assert router.dp_rule == "switchyard"
    before = metric("switchyard_router_decisions_total", kind="dp", policy="switchyard", fallback="")
    stubs = [StubConfig("a", waiting_prefill_tokens=50_000), StubConfig("b")]
    body = {"model": "stub-model", "prompt": "hi", "max_tokens": 2}
    async with deployment(settings, bus, stubs, router_settings=router) as (gateway, engines):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            for _ in range(4):
                answer = await client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
        assert len(engines["b"].received) == 4 and not engines["a"].received
        counted = lambda: metric("switchyard_router_decisions_total", kind="dp", policy="switchyard", fallback="")  # noqa: E731
        await wait_for(lambda: counted() == before + 4)  # folded in by the router's housekeeping (1 s)


def test_with_a_manifest_only_the_engines_it_binds_are_indexed() -> None:
    """e1's hello claims a role its manifest entry does not list, e2 is not listed: neither is known, so their
    events are refused as from an unknown engine; e0, listed as it announces, is indexed."""
    manifest = EngineManifest({"e0": EngineEntry(role="dp"), "e1": EngineEntry(role="prefill")})
    core = RouterCore(router_settings(), manifest=manifest)
    for engine_id in ("e0", "e1", "e2"):
        core.on_hello(_hello(engine_id), 0.0)
        core.on_telemetry(telemetry(engine_id, 0), 0.0)
    assert core.on_kv(_events("e0", 0), 0.0) is None
    assert core.on_kv(_events("e1", 0), 0.0) == "unknown_engine"
    assert core.on_kv(_events("e2", 0), 0.0) == "unknown_engine"
    assert core.prefix.engines() == {"e0"}


async def test_malformed_kv_events_are_rejected_and_counted(fleet: Fleet, bus: Bus) -> None:
    """Not msgpack, a schema violation (a 'cleared' op with keys), too many keys: each dropped with its reason,
    counted by the subscription like every other; e1's next well-formed message is applied."""
    e1, subscription = fleet.engines["e1"], bus.subjects.all_kv_events
    codes = ("not_msgpack", "schema", "too_large")
    before = {code: rejected_count(subscription, code) for code in codes}
    subject = bus.subjects.kv_events("e1")
    bad_op = msgpack.unpackb(encode(e1.events(stored(KEYS[:2]), seq=0)))
    bad_op["ops"][0]["kind"] = "cleared"  # a 'cleared' op carrying keys
    await bus.nc.publish(subject, b"\xc1 not msgpack")
    await bus.nc.publish(subject, msgpack.packb(bad_op))
    await bus.nc.publish(subject, b"\x00" * (s.KvEvents.MAX_WIRE_BYTES + 1))
    await e1.kv(stored(KEYS[:4]))
    await fleet.until(lambda: fleet.blocks("e1") == 4)
    assert {code: rejected_count(subscription, code) - before[code] for code in codes} == dict.fromkeys(codes, 1)


def test_a_cached_prompt_counts_in_flight_only_for_what_it_leaves_to_compute() -> None:
    core = _core()  # the switchyard profile
    for engine_id in ("e0", "e1"):
        core.on_hello(_hello(engine_id), 0.0)
        core.on_telemetry(telemetry(engine_id, 0), 0.0)
    core.on_kv(_events("e1", 0, KEYS[:48]), 0.0)  # e1 holds the first 768 of the prompt's 1,024 tokens
    routed = core.route_dp(s.RouteDpRequest(request_id="r", prompt_tokens=1024, block_keys=KEYS), 0.01)
    assert routed.reply.engine_id == "e1"
    e0, e1 = core.fleet.index["e0"], core.fleet.index["e1"]
    assert core.fleet.inflight_tokens[e1] == 1024 - 48 * BLOCK  # what its prefill will compute
    assert core.fleet.inflight_tokens[e0] == 0
    assert routed.decision is not None and routed.decision.prompt_tokens == 1024 - 48 * BLOCK  # shared alike


def test_a_prompt_no_engine_holds_skips_the_match_and_decides_as_the_full_match_would() -> None:
    """`PrefixState.fresh`: no engine holds the prompt's first block, so the decision skips the match (nothing is
    cached anywhere) and picks what the full match's zeros would; a prompt an engine holds is matched as before.
    The gateway's in-process `LocalDpAsk` decides as the wire's `RouteDpRequest` does."""
    fresh_keys = KEYS + np.uint64(1)  # no engine holds any of these
    cores = {}
    for how in ("fast", "full"):
        core = cores[how] = _core()
        for i, engine_id in enumerate(("e0", "e1", "e2")):
            core.on_hello(_hello(engine_id), 0.0)
            core.on_telemetry(telemetry(engine_id, 0).model_copy(update={"num_waiting": 2 - i}), 0.0)
        core.on_kv(_events("e0", 0, KEYS[:8]), 0.0)
        if how == "full":  # the match the fast path skips: every engine reports 0 cached
            core.prefix.fresh = lambda request, engine_ids: False  # type: ignore[method-assign]
    assert cores["fast"].prefix.fresh(
        s.RouteDpRequest(request_id="q", prompt_tokens=64, block_keys=fresh_keys), ("e0", "e1", "e2")
    )
    assert not cores["fast"].prefix.fresh(s.RouteDpRequest(request_id="q", prompt_tokens=64, block_keys=KEYS), ("e0",))
    picks: dict[str, list[str]] = {"fast": [], "full": [], "local": []}
    local = _core()
    for i, engine_id in enumerate(("e0", "e1", "e2")):
        local.on_hello(_hello(engine_id), 0.0)
        local.on_telemetry(telemetry(engine_id, 0).model_copy(update={"num_waiting": 2 - i}), 0.0)
    local.on_kv(_events("e0", 0, KEYS[:8]), 0.0)
    for n, keys in enumerate([fresh_keys, KEYS, fresh_keys, fresh_keys, KEYS[:4], fresh_keys]):
        request = s.RouteDpRequest(request_id=f"r{n}", prompt_tokens=len(keys) * BLOCK, block_keys=keys, progress=True)
        for how in ("fast", "full"):
            picks[how].append(cores[how].route_dp(request, 0.01 * n).reply.engine_id)
        ask = LocalDpAsk(f"r{n}", len(keys) * BLOCK, None, keys, "tokens", True)
        picks["local"].append(local.route_dp(ask, 0.01 * n).reply.engine_id)
    assert picks["fast"] == picks["full"] == picks["local"]
    assert picks["fast"][1] == "e0" and len(set(picks["fast"])) > 1  # the held prompt went to its holder; not all alike
