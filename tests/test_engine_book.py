"""The engine book (`services/engine_book`): one admission, liveness and sequence check per process, and the
projections that read it (router columns, gateway registry, fleet view); the one KV-event applier."""

from __future__ import annotations

import numpy as np

from switchyard.services.engine_book import EngineBook
from switchyard.services.fleet_view import FleetView
from switchyard.services.gateway.registry import GatewayRegistry
from switchyard.services.router.ask import LocalDpAsk
from switchyard.services.router.core import RouterCore
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.engine_manifest import EngineEntry, EngineManifest
from switchyard.shared.liveness import Liveness
from switchyard.shared.schemas import Capacity, Hello, KvEvents, KvOp, ModelShape
from switchyard.shared.sequence import Seq
from switchyard.solver.routing.prefix import BlockIndex, KvApplier
from tests.helpers import telemetry


def hello(
    engine_id: str, base_url: str | None = "http://127.0.0.1:1", group: str | None = None, rank: int = 0
) -> Hello:
    return Hello(
        engine_id=engine_id,
        role="dp",
        model=ModelShape(name="m", num_layers=2, num_experts=4, top_k=1),
        ep_group=group or f"g-{engine_id}",
        dp_rank=rank,
        gpus=["0"],
        capacity=Capacity(max_running=8, kv_blocks=10, block_size=16),
        ts=0.0,
        agent="sim",
        hello_interval_s=1.0,
        base_url=base_url,
    )


def in_process(book: EngineBook) -> tuple[GatewayRegistry, RouterCore]:
    """What the in-process gateway builds: a registry and a core over one book."""
    return GatewayRegistry(book), RouterCore(RouterSettings(dp_profile="jsq", fresh_load_s=60.0), book=book)


def test_one_book_feeds_registry_and_core_once() -> None:
    book = EngineBook(Liveness(3.0, 15.0), claims=False)
    registry, core = in_process(book)
    book.on_telemetry(telemetry("a", 1), now=0.0)  # before its hello: held, counted once the hello comes
    book.on_hello(hello("a"), now=0.1)
    book.on_hello(hello("b"), now=0.1)
    assert [e.engine_id for e in registry.live(now=0.2)] == ["a", "b"]
    assert set(core.fleet.index) == {"a", "b"} and core.fleet.last_seq[core.fleet.index["a"]] == 1
    assert registry.engines["a"].last_seq == 1  # the same stamp, not a second sequence check
    book.on_telemetry(telemetry("a", 100), now=0.2)
    book.on_telemetry(telemetry("a", 0), now=0.3)  # a restart: seen once, by everyone
    assert book.counters.engine_restarts == 1 and core.fleet.last_seq[core.fleet.index["a"]] == 0


def test_the_core_never_chooses_what_the_registry_holds_out() -> None:
    """Ejected, on-trial-and-busy and URL-less engines are held in the book: the core's choice is always one of
    the registry's candidates (so nothing re-filters it)."""
    book = EngineBook(Liveness(3.0, 15.0), claims=False)
    registry, core = in_process(book)
    for engine_id in ("a", "b"):
        book.on_hello(hello(engine_id), now=0.0)
        book.on_telemetry(telemetry(engine_id, 1), now=0.0)
    book.on_hello(hello("c", base_url=None), now=0.0)
    book.on_telemetry(telemetry("c", 1), now=0.0)
    registry.hop_failed(registry.engines["a"], hostile=True, now=0.0)
    for i in range(20):
        reply, decided = core.route_dp(LocalDpAsk(f"r{i}", 10, "m", None, "tokens", False), now=0.1)
        assert decided is not None and decided.engine_id == "b", reply
    registry.put_on_trial(registry.engines["a"])
    registry.hop_begun(registry.engines["a"])  # its one trial request is in flight
    assert [e.engine_id for e in registry.live(now=0.1)] == ["b"]
    assert all(
        core.route_dp(LocalDpAsk(f"t{i}", 10, "m", None, "tokens", False), 0.1)[1].engine_id == "b" for i in range(9)
    )
    registry.hop_succeeded(registry.engines["a"])
    chosen = {core.route_dp(LocalDpAsk(f"u{i}", 10, "m", None, "tokens", False), 0.2)[1].engine_id for i in range(20)}
    assert "a" in chosen and "c" not in chosen  # back in rotation (the least loaded now); "c" (no HTTP) never


def test_the_id_cap_evicts_only_dead_engines_and_a_manifest_refuses_for_every_projection() -> None:
    manifest = EngineManifest({f"e{i}": EngineEntry() for i in range(4)})
    book = EngineBook(Liveness(3.0, 15.0), manifest, max_engines=2, claims=False)
    registry, core = in_process(book)
    book.on_hello(hello("x"), now=0.0)  # unlisted: refused by the book, so by every projection
    assert "x" not in book and "x" not in registry.engines and "x" not in core.fleet.index
    book.on_hello(hello("e0"), now=0.0)
    book.on_hello(hello("e1"), now=0.0)
    assert book.on_hello(hello("e2"), now=1.0) is None  # both live: refused
    assert book.counters.engines_refused == 1
    book.on_hello(hello("e1"), now=3.5)  # e0 dead at 3.0, e1 live
    assert book.on_hello(hello("e2"), now=3.6) is not None
    assert set(book.entries) == {"e1", "e2"} and set(core.fleet.index) == {"e1", "e2"}
    assert set(registry.engines) == {"e1", "e2"}


def test_the_fleet_view_refuses_a_live_place_through_its_book() -> None:
    now = [0.0]
    view = FleetView(clock=lambda: now[0], liveness=Liveness(3.0, 15.0))
    view.on_hello(hello("a", group="g", rank=0))
    view.on_hello(hello("b", group="g", rank=0))  # a live engine's place
    assert view.group("g")[0].engine_id == "a" and "b" not in view.engines
    now[0] = 4.0  # a is dead: its place is free
    view.on_hello(hello("b", group="g", rank=0))
    assert view.coordinator("g") == "b"


def _events(seq: int, *keys: int, kind: str = "stored") -> KvEvents:
    return KvEvents(
        engine_id="e", seq=seq, ts=0.0, block_size=16, ops=[KvOp(kind=kind, keys=np.array(keys, dtype=np.uint64))]
    )


def test_one_kv_applier_one_sequence_rule() -> None:
    applier = KvApplier(BlockIndex(100))
    assert applier.apply(_events(0, 1, 2)).event is Seq.FIRST
    assert applier.apply(_events(1, 3)).event is Seq.NEXT and applier.blocks.blocks("e") == 3
    assert applier.apply(_events(0, 9)).event is Seq.LATE  # a small step back: dropped, nothing applied
    assert applier.blocks.blocks("e") == 3 and applier.last("e") == 1
    assert applier.apply(_events(5, 7)).event is Seq.GAP  # events lost: cleared, then applied
    assert applier.blocks.blocks("e") == 1
    assert applier.apply(_events(3000, 8), capacity=5).event is Seq.GAP
    assert applier.apply(_events(0, 4, 5)).event is Seq.RESTART and applier.blocks.blocks("e") == 2
