"""Issue 24, item 1: one liveness rule (`shared/liveness.py`), and every service agrees on it.

The router (`TelemetryView`), the gateway (`GatewayRegistry`) and the fleet view the API, placement and migration
use (`FleetView`) are fed the same hellos and telemetry on one controllable clock; at every instant of a fine
time grid (and at every engine's deadline, to the float) their live sets are equal, and the router's routing
candidates (live, with fresh load data) are among them.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.engine_agents.stub import StubConfig
from switchyard.services.fleet_view import FleetView
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.services.router.telemetry_view import ROLES, TelemetryView
from switchyard.shared.bus import Bus
from switchyard.shared.liveness import Liveness, LivenessSettings
from switchyard.shared.schemas import Capacity, Hello, ModelShape, Telemetry
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment, wait_for
from tests.helpers import telemetry

SHAPE = ModelShape(name="m", num_layers=2, num_experts=8, top_k=2)
IDS = ("e0", "e1", "e2")


def hello(engine_id: str, role: str = "decode", hello_s: float = 5.0, telemetry_s: float = 0.1) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        model=SHAPE,
        ep_group=f"g-{engine_id}",  # a place of its own: the fleet view refuses a live engine's place to others
        dp_rank=0,
        gpus=[f"{engine_id}-gpu0"],
        capacity=Capacity(max_running=32, kv_blocks=100, block_size=16),
        ts=0.0,
        agent="sim",
        base_url=f"http://{engine_id}.invalid:8000",
        hello_interval_s=hello_s,
        telemetry_interval_s=telemetry_s,
    )


# ----- the rule -----


def test_the_rule_windows_each_signal_by_its_own_interval_capped() -> None:
    rule = Liveness(misses=3.0, max_silence_s=15.0)
    assert rule.window(1.0) == 3.0 and rule.window(60.0) == 15.0  # a sender's long interval is capped
    assert rule.live_until(10.0, 1.0) == 13.0
    assert rule.live_until(10.0, 60.0) == 25.0  # not 10 + 180
    assert rule.live_until(10.0, 5.0, 20.0, 0.1) == 25.0  # the later of the two windows
    assert rule.live_until(None, 5.0, 20.0, 0.1) == pytest.approx(20.3)
    assert rule.live_until(None, 5.0, None, 0.1) == -math.inf  # never heard from
    assert rule.is_live(13.0, 13.0) and not rule.is_live(13.0, 13.0000001)
    with pytest.raises(ValueError, match="misses"):
        Liveness(misses=0.0)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(0, 1e4)),
            st.floats(0.01, 60.0),
            st.one_of(st.none(), st.floats(0, 1e4)),
            st.floats(0.01, 60.0),
        ),
        min_size=1,
        max_size=20,
    ),
    st.floats(0.5, 10.0),
    st.floats(0.1, 100.0),
)
def test_the_columns_form_gives_the_scalar_forms_floats(rows: list, misses: float, cap: float) -> None:
    rule = Liveness(misses, cap)

    def column(i: int) -> np.ndarray:
        return np.array([-np.inf if row[i] is None else row[i] for row in rows])

    columns = rule.live_until_columns(column(0), column(1), column(2), column(3))
    assert columns.tolist() == [rule.live_until(*row) for row in rows]


def test_settings_names_old_and_new(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SWITCHYARD_LIVENESS_MISSES", "SWITCHYARD_LIVENESS_MAX_SILENCE_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SWITCHYARD_GATEWAY_HELLO_MISSES", "4")
    monkeypatch.setenv("SWITCHYARD_GATEWAY_STALE_AFTER_S", "9")
    assert LivenessSettings().rule() == Liveness(4.0, 9.0)  # the gateway's old names, now for every service
    monkeypatch.setenv("SWITCHYARD_LIVENESS_MISSES", "2")
    monkeypatch.setenv("SWITCHYARD_LIVENESS_MAX_SILENCE_S", "7")
    assert LivenessSettings().rule() == Liveness(2.0, 7.0)  # the new names win
    assert FleetView(clock=lambda: 0.0).liveness == Liveness(2.0, 7.0)
    assert FleetView(clock=lambda: 0.0, stale_intervals=5.0).liveness == Liveness(5.0, 7.0)


# ----- every service agrees -----


class Services:
    """The router's, the gateway's and the fleet view's engine views on one clock."""

    def __init__(self, rule: Liveness) -> None:
        self.now = 0.0
        self.router = TelemetryView(fresh_load_s=1.0, liveness=rule)
        self.gateway = GatewayRegistry(liveness=rule)
        self.fleet = FleetView(clock=lambda: self.now, liveness=rule)

    def hello(self, message: Hello) -> None:
        self.router.on_hello(message, self.now)
        self.gateway.on_hello(message, self.now)
        self.fleet.on_hello(message)

    def telemetry(self, message: Telemetry) -> None:
        self.router.on_telemetry(message, self.now)
        self.gateway.on_telemetry(message, self.now)
        self.fleet.on_telemetry(message)

    def live(self, now: float) -> tuple[set[str], set[str], set[str]]:
        self.now = now
        router = self.router
        router_live = {router.engine_ids[i] for i in np.flatnonzero(router.live(now))}
        gateway_live = {e.engine_id for e in self.gateway.live(now=now)}
        fleet_live = {e for e, s in self.fleet.engines.items() if s.hello is not None and not self.fleet.is_stale(s)}
        return router_live, gateway_live, fleet_live

    def candidates(self, now: float) -> set[str]:
        """Engines the router would route to now (any role)."""
        router = self.router
        return {router.engine_ids[i] for role in ROLES for i in np.flatnonzero(router.alive(role, now))}


INTERVALS = st.sampled_from([0.05, 0.1, 0.25, 1.0, 2.0, 5.0, 60.0])
EVENT = st.tuples(
    st.sampled_from(IDS),
    st.sampled_from(["hello", "telemetry", "telemetry", "late", "restart"]),
    INTERVALS,  # hello interval (a hello's)
    INTERVALS,  # telemetry interval (a hello's)
    st.floats(0.0, 4.0),  # time to the next event
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(EVENT, min_size=1, max_size=25),
    st.sampled_from([1.0, 3.0]),
    st.sampled_from([0.5, 2.0, 15.0]),
)
def test_every_service_counts_the_same_engines_live_at_every_instant(
    events: list[tuple[str, str, float, float, float]], misses: float, cap: float
) -> None:
    """One sequence of hellos and telemetry (telemetry before an engine's first hello, late and restarted
    sequence numbers included): router, gateway and fleet view agree at every instant."""
    rule = Liveness(misses, cap)
    services = Services(rule)
    seq = dict.fromkeys(IDS, -1)
    said_hello: set[str] = set()
    now, deadlines = 0.0, []

    def check(at: float) -> None:
        router, gateway, fleet = services.live(at)
        assert router == gateway == fleet, (at, router, gateway, fleet)
        assert services.candidates(at) <= gateway  # the router routes only to engines the gateway counts live

    for engine_id, kind, hello_s, telemetry_s, step in events:
        if kind == "hello":
            services.hello(hello(engine_id, hello_s=hello_s, telemetry_s=telemetry_s))
            said_hello.add(engine_id)
        elif kind == "late" and seq[engine_id] >= 2:
            services.telemetry(telemetry(engine_id, seq[engine_id] - 1))  # older than the last: counts nowhere
        else:
            seq[engine_id] = 0 if kind == "restart" else seq[engine_id] + 1
            services.telemetry(telemetry(engine_id, seq[engine_id]))
        for e in said_hello:
            until = float(services.router.live_until[services.router.index[e]])
            deadlines += [until, math.nextafter(until, math.inf)]
        grid = np.arange(now, now + step, 0.01)
        for at in sorted({*grid.tolist(), *(d for d in deadlines if now <= d < now + step)}):  # clocks go forward
            check(at)
        now += step
        services.now = now
    check(now)
    check(now + 2 * cap)  # everyone silent past the cap: nobody live anywhere
    assert services.live(now + 2 * cap) == (set(), set(), set())


def test_an_engine_live_by_telemetry_alone_stays_live_everywhere() -> None:
    """Its hellos stopped (0.1 s interval) but its telemetry goes on (1 s): live for everyone while telemetry
    comes; the gateway used to drop it 0.3 s after its last hello while the fleet view kept it."""
    services = Services(Liveness(3.0, 15.0))
    services.hello(hello("e0", hello_s=0.1, telemetry_s=1.0))
    for seq, at in enumerate([0.5, 2.0, 4.5]):
        services.now = at
        services.telemetry(telemetry("e0", seq))
        assert services.live(at + 0.4) == ({"e0"}, {"e0"}, {"e0"})
    assert services.live(4.5 + 3.0) == ({"e0"}, {"e0"}, {"e0"})
    assert services.live(4.5 + 3.0001) == (set(), set(), set())


def test_a_long_announced_interval_is_capped_for_every_service() -> None:
    """A sender announcing 60 s intervals is dead for everyone `max_silence_s` after its last word (the fleet
    view used to keep it 3 x 60 s: a dead engine held its group's place for three minutes)."""
    services = Services(Liveness(3.0, 15.0))
    services.hello(hello("e0", hello_s=60.0, telemetry_s=60.0))
    assert services.live(15.0) == ({"e0"}, {"e0"}, {"e0"})
    assert services.live(15.001) == (set(), set(), set())


def test_the_router_routes_by_fresh_load_data_within_the_live_ones() -> None:
    """Telemetry stopped, hellos go on: live for every service, but the router has no fresh load data after
    `fresh_load_s` and does not route there (the gateway counts it live; it is not dead)."""
    services = Services(Liveness(3.0, 15.0))
    services.hello(hello("e0", hello_s=5.0, telemetry_s=0.1))
    services.now = 0.05
    services.telemetry(telemetry("e0", 0))
    assert services.candidates(1.0) == {"e0"}
    assert services.candidates(1.2) == set() and services.live(1.2) == ({"e0"}, {"e0"}, {"e0"})
    services.now = 5.0
    services.hello(hello("e0"))
    assert services.candidates(5.5) == {"e0"}  # a hello is fresh news too (as before)


# ----- on a real nats-server -----


async def test_router_gateway_and_fleet_view_drop_a_silent_engine_together(
    bus: Bus, settings: SwitchyardSettings
) -> None:
    """Stub engines on a real bus, a router and a gateway service and a fleet view (the API's, placement's and
    migration's) subscribed as those services are: while both engines talk, all three count both live; when
    one falls silent (no hello, no telemetry) all three drop it, within delivery skew of each other, about
    3 of its 0.5 s hello intervals after its last hello, and keep the other."""
    router = RouterService(settings, RouterSettings(inflight_grace_s=0.0, fresh_load_s=5.0))
    await router.start()
    view = FleetView()
    subscriptions = await view.subscribe(bus, "liveness-test")
    stubs = [StubConfig("a", hello_interval_s=0.5), StubConfig("b", hello_interval_s=1.0)]
    try:
        async with deployment(settings, bus, stubs, router=False) as (gateway, engines):
            fleet = router.core.fleet

            def live_sets() -> tuple[set[str], set[str], set[str]]:
                router_live = {fleet.engine_ids[i] for i in np.flatnonzero(fleet.live(time.monotonic()))}
                gateway_live = {e.engine_id for e in gateway.registry.live()}
                fleet_live = {e for e, s in view.engines.items() if s.hello is not None and not view.is_stale(s)}
                return router_live, gateway_live, fleet_live

            await wait_for(lambda: live_sets() == ({"a", "b"},) * 3)
            engines["a"].saying_hello = False
            silent_at = time.monotonic()
            dropped: dict[str, float] = {}
            async with asyncio.timeout(20):
                while len(dropped) < 3:
                    for name, live in zip(("router", "gateway", "fleet view"), live_sets(), strict=True):
                        if "a" not in live:
                            dropped.setdefault(name, time.monotonic() - silent_at)
                        assert "b" in live, name
                    await asyncio.sleep(0.005)
            assert max(dropped.values()) - min(dropped.values()) < 1.0, dropped  # the same rule, on each one's clock
            assert min(dropped.values()) > 0.3 and max(dropped.values()) < 5.0, dropped  # ~1.5 s: 3 x 0.5 s
            assert live_sets() == ({"b"},) * 3
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()
        await router.stop()


def test_the_gateway_service_reads_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway built from the environment judges by `SWITCHYARD_LIVENESS_*`, as the router and the fleet view
    do, and nothing overrides it for the gateway alone (its `hello_misses` / `stale_after_s` are gone)."""
    from switchyard.services.gateway.service import GatewayService
    from switchyard.services.gateway.settings import GatewaySettings
    from switchyard.services.router.core import RouterCore

    for name in ("SWITCHYARD_GATEWAY_HELLO_MISSES", "SWITCHYARD_GATEWAY_STALE_AFTER_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SWITCHYARD_LIVENESS_MISSES", "2")
    monkeypatch.setenv("SWITCHYARD_LIVENESS_MAX_SILENCE_S", "6")
    settings = SwitchyardSettings(nats_servers=["nats://127.0.0.1:1"])
    assert GatewayService(settings, GatewaySettings()).registry.liveness == Liveness(2.0, 6.0)
    assert RouterCore(RouterSettings(policy="jsq")).fleet.liveness == Liveness(2.0, 6.0)
    assert FleetView().liveness == Liveness(2.0, 6.0)
    service = GatewayService(settings, GatewaySettings())
    assert service.core is not None and service.core.book is service.registry.book  # one book in the process
    assert not {"hello_misses", "stale_after_s"} & set(GatewaySettings.model_fields)


def test_the_gateway_keeps_early_telemetry_bounded() -> None:
    """Telemetry before a hello is kept for it (the router and the fleet view count it), but ids are the senders'
    word: at most `max_engines` are kept, and none older than `max_silence_s` past housekeeping."""
    registry = GatewayRegistry(liveness=Liveness(3.0, 15.0), max_engines=8)
    for i in range(100):
        registry.on_telemetry(telemetry(f"x{i}", 0), now=float(i) / 100)
    assert len(registry.book) <= 8
    registry.forget_dead(now=100.0)
    assert len(registry.book) == 0
    registry.on_telemetry(telemetry("e0", 5), now=200.0)
    registry.on_telemetry(telemetry("e0", 4), now=200.5)  # late: not newer news
    registry.on_hello(hello("e0", hello_s=0.1, telemetry_s=1.0), now=200.6)
    assert registry.engines["e0"].last_telemetry == 200.0 and registry.engines["e0"].last_seq == 5
    assert registry.get_live("e0", now=203.0) is not None and registry.get_live("e0", now=203.01) is None
