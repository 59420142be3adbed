"""The HTTP API served by uvicorn in-process, on SQLite and PostgreSQL, against real NATS; fuzzed by schemathesis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import hypothesis
import numpy as np
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.services.api.app import create_app
from switchyard.services.api.server import run_api
from switchyard.services.api.settings import ApiSettings
from switchyard.services.history import add_placement
from switchyard.services.migration.planner import plan_steps
from switchyard.services.placement.service import PlacementService
from switchyard.services.placement.settings import PlacementSettings
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode
from switchyard.shared.db import Calibration, Engine, Migration, MigrationMove, create_async_db, upgrade
from switchyard.shared.embedded import free_port
from switchyard.shared.schemas import CalibrationRequest, ModelShape, PlacementPlan, RoutingArtifact, Telemetry
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.placement.layouts import default_layout
from switchyard.solver.placement.moves import apply_moves
from tests.fleet_helpers import announcing, hello, plan, publish_load, running, shuffled
from tests.helpers import eventually

TOKEN = "s3cret-token"


def old_engine() -> Engine:
    """An engine known from an earlier hello but not heard since the API started."""
    return Engine(
        engine_id="old-e9",
        role="decode",
        ep_group="g9",
        agent="sim",
        model_name="m",
        num_layers=2,
        num_experts=8,
        top_k=2,
        hello={"dp_rank": 0, "gpus": ["x"]},
    )


LAYERS, EXPERTS, GPUS = 2, 8, 2


@contextlib.asynccontextmanager
async def api_server(
    settings: SwitchyardSettings, token: str | None = TOKEN, request_timeout_s: float = 10
) -> AsyncIterator[httpx.AsyncClient]:
    """`switchyard api` as an asyncio task on a free port, and a client for it (`request_timeout_s` per request)."""
    config = ApiSettings(host="127.0.0.1", port=free_port(), token=token)
    stop = asyncio.Event()
    task = asyncio.create_task(run_api(settings, stop, config))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}", timeout=request_timeout_s) as client:

        async def up() -> bool:
            if task.done():
                task.result()  # surface a failed start
            with contextlib.suppress(httpx.TransportError):
                return (await client.get("/healthz")).status_code == 200
            return False

        await eventually(up, timeout=30)
        try:
            yield client
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


@pytest.fixture
def db_settings(settings: SwitchyardSettings, database_url: str) -> SwitchyardSettings:
    upgrade(database_url)
    return settings.model_copy(update={"database_url": database_url})


@pytest.fixture
async def sessions(db_settings: SwitchyardSettings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine, factory = create_async_db(db_settings.resolved_database_url())
    yield factory
    await engine.dispose()


async def seed(sessions: async_sessionmaker[AsyncSession]) -> dict[str, int]:
    """g0: v1 applied (with a finished migration), v2 rejected (no layout), v3 published; two calibrations."""
    base = default_layout(LAYERS, EXPERTS, GPUS)
    first, third = shuffled(base, 1), shuffled(base, 3)
    ids: dict[str, int] = {}
    async with sessions() as session, session.begin():
        v1 = await add_placement(session, plan("g0", 1, first), "applied")
        v2 = await add_placement(
            session, plan("g0", 2, shuffled(base, 2)), "rejected", parent_id=v1.id, store_layout=False
        )
        v3 = await add_placement(session, plan("g0", 3, third, source="minlp"), "published", parent_id=v1.id)
        migration = Migration(placement_id=v1.id, engine_group="g0", plan_version=1, state="succeeded")
        session.add(migration)
        await session.flush()
        for step, moves in enumerate(plan_steps(base, first)):
            for seq, move in enumerate(moves.tolist()):
                layer, expert, sg, ss, dg, ds = move
                session.add(
                    MigrationMove(
                        migration_id=migration.id,
                        seq=step * 100 + seq,
                        step=step,
                        engine_id="e0",
                        layer=layer,
                        expert=expert,
                        src_gpu=sg,
                        src_slot=ss,
                        dst_gpu=dg,
                        dst_slot=ds,
                        state="applied",
                        attempts=1,
                    )
                )
        for group in ("g0", None):
            session.add(
                Calibration(
                    engine_group=group,
                    params={"comm": 1.0, "load": 0.5, "mig": 1.0},
                    agreement=0.85,
                    comm_gap=0.004,
                    solve_seconds=3.2,
                    num_windows=4,
                )
            )
        ids.update(v1=v1.id, v2=v2.id, v3=v3.id, migration=migration.id)
    return ids


async def test_history_reads(db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]) -> None:
    ids = await seed(sessions)
    async with api_server(db_settings) as api:
        page = (await api.get("/v1/placements", params={"limit": 2})).json()
        assert [p["version"] for p in page["items"]] == [3, 2] and page["next_cursor"]
        rest = (await api.get("/v1/placements", params={"limit": 2, "cursor": page["next_cursor"]})).json()
        assert [p["version"] for p in rest["items"]] == [1] and rest["next_cursor"] is None
        v3 = page["items"][0]
        assert v3["params"] == {"comm": 1.0, "load": 0.0025, "mig": 1.0}  # alpha, beta, gamma by term
        assert v3["objective"] == {"load": 1.0, "comm": 2.0, "mig": 0.5, "total": 3.5}
        for query, versions in [
            ({"source": "minlp"}, [3]),
            ({"status": "rejected"}, [2]),
            ({"engine_group": "other"}, []),
            ({"until": (datetime.now(UTC) - timedelta(days=1)).isoformat()}, []),
            ({"since": "2000-01-01T00:00:00"}, [3, 2, 1]),
        ]:
            got = (await api.get("/v1/placements", params=query)).json()["items"]
            assert [p["version"] for p in got] == versions, query

        detail = (await api.get(f"/v1/placements/{ids['v3']}")).json()
        assert (detail["predecessor_id"], detail["diff_base"], detail["migration"]) == (ids["v1"], "predecessor", None)
        first = np.array((await api.get(f"/v1/placements/{ids['v1']}")).json()["layout"])
        moves = np.array(
            [
                [mv[c] for c in ("layer", "expert", "src_gpu", "src_slot", "dst_gpu", "dst_slot")]
                for mv in detail["diff"]
            ]
        )
        np.testing.assert_array_equal(apply_moves(first, moves, buffer=True), np.array(detail["layout"]))
        rejected = (await api.get(f"/v1/placements/{ids['v2']}")).json()
        assert rejected["layout"] is None and rejected["diff"] is None

        current = (await api.get("/v1/placements/current", params={"engine_group": "g0"})).json()
        assert current["id"] == ids["v1"] and current["diff_base"] == "default"
        assert current["migration"]["state"] == "succeeded" and set(current["migration"]["moves_by_state"]) == {
            "applied"
        }
        missing = await api.get("/v1/placements/current", params={"engine_group": "nope"})
        assert missing.status_code == 404 and "runs the default layout" in missing.json()["detail"]
        assert (await api.get("/v1/placements/999999")).status_code == 404
        bad = await api.get("/v1/placements", params={"cursor": "garbage"})
        assert bad.status_code == 400 and "invalid cursor" in bad.json()["detail"]

        migrations = (await api.get("/v1/migrations", params={"state": "succeeded"})).json()["items"]
        assert [mg["id"] for mg in migrations] == [ids["migration"]]
        migration = (await api.get(f"/v1/migrations/{ids['migration']}")).json()
        assert migration["moves"] and {mv["state"] for mv in migration["moves"]} == {"applied"}
        calibrations = (await api.get("/v1/calibrations")).json()["items"]
        assert [c["engine_group"] for c in calibrations] == [None, "g0"] and calibrations[0]["agreement"] == 0.85
        assert calibrations[0]["params"] == {"comm": 1.0, "load": 0.5, "mig": 1.0}


async def test_writes_need_the_token(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    ids = await seed(sessions)
    async with api_server(db_settings, token=None) as api:
        refused = await api.post(f"/v1/placements/{ids['v1']}/reapply", headers={"Authorization": f"Bearer {TOKEN}"})
        assert refused.status_code == 403 and "set SWITCHYARD_API_TOKEN" in refused.json()["detail"]
    async with api_server(db_settings) as api:
        assert (await api.post("/v1/calibrations")).status_code == 401
        wrong = await api.post(f"/v1/placements/{ids['v1']}/reapply", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid bearer token"
        assert len((await api.get("/v1/placements")).json()["items"]) == 3  # nothing was written

        auth = {"Authorization": f"Bearer {TOKEN}"}
        rollback = await api.post(f"/v1/placements/{ids['v3']}/reapply", headers=auth)
        assert rollback.status_code == 202, rollback.text
        row = rollback.json()
        assert (row["version"], row["source"], row["status"]) == (4, "rollback", "published")
        assert row["parent_id"] == ids["v1"] and row["details"]["reapplied_from"] == ids["v3"]
        stored = await bus.js.get_last_msg(bus.subjects.placement_stream, bus.subjects.placement_plan)
        published = decode(stored.data, PlacementPlan)
        assert published.plan_id == row["plan_id"] and published.base_version == 1
        layout = (await api.get(f"/v1/placements/{ids['v3']}")).json()["layout"]
        np.testing.assert_array_equal(published.placement, np.array(layout))
        assert (await api.post(f"/v1/placements/{ids['v2']}/reapply", headers=auth)).status_code == 409

        queued = await api.post("/v1/calibrations", headers=auth, json={"engine_group": "g0", "time_limit_s": 0.5})
        assert queued.status_code == 202, queued.text
        stored = await bus.js.get_last_msg(bus.subjects.placement_stream, bus.subjects.calibration_request)
        request = decode(stored.data, CalibrationRequest)
        assert (request.request_id, request.engine_group) == (queued.json()["request_id"], "g0")
        invalid = await api.post("/v1/calibrations", headers=auth, json={"time_limit_s": -1})
        assert invalid.status_code == 422


async def test_a_triggered_calibration_is_recorded(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await bus.ensure_streams()
    await publish_load(bus, "e0", "g0", 0, range(4))
    await publish_load(bus, "e1", "g0", 1, range(2, 8))
    placement = PlacementService(db_settings, PlacementSettings(period_s=3600, tick_s=0.05, warmup_s=3600))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    hellos = hello("e0", "g0", ["a", "b"], 0), hello("e1", "g0", ["c", "d"], 1)
    async with announcing(bus, *hellos), running(placement.run), api_server(db_settings) as api:
        await asyncio.wait_for(placement.caught_up.wait(), 10)
        await eventually(lambda: _known(placement, "g0"))  # the service needs g0's GPUs from the hellos
        ok = await api.post("/v1/calibrations", headers=auth, json={"engine_group": "g0", "time_limit_s": 0.2})
        nothing = await api.post("/v1/calibrations", headers=auth, json={"engine_group": "nowhere"})
        wanted = {ok.json()["request_id"], nothing.json()["request_id"]}

        async def recorded() -> dict | None:
            rows = (await api.get("/v1/calibrations")).json()["items"]
            found = {row["details"].get("request_id"): row for row in rows}
            return found if wanted <= set(found) else None

        rows = await eventually(recorded, timeout=60)

        # A redelivered request (same request id, e.g. after a crash before its ack) is answered once only.
        subject = bus.subjects.calibration_request
        stored = decode((await bus.js.get_last_msg(bus.subjects.placement_stream, subject)).data, CalibrationRequest)
        assert stored.request_id == nothing.json()["request_id"]
        await bus.js_publish(subject, stored, msg_id="redelivered")
        marker = await api.post("/v1/calibrations", headers=auth, json={"engine_group": "nowhere"})
        wanted.add(marker.json()["request_id"])
        await eventually(recorded, timeout=60)  # requests run in order: the duplicate was handled before
        ids = [row["details"].get("request_id") for row in (await api.get("/v1/calibrations")).json()["items"]]
        assert ids.count(stored.request_id) == 1
    done, failed = rows[ok.json()["request_id"]], rows[nothing.json()["request_id"]]
    assert (done["status"], done["engine_group"], done["num_windows"]) == ("succeeded", "g0", 1)
    assert done["details"]["trigger"] == "api" and 0.0 <= done["agreement"] <= 1.0
    assert done["details"]["time_limit_s"] == 0.2 and done["details"]["budget_s"] == 300.0
    assert failed["status"] == "failed" and "no expert-load window for nowhere" in failed["details"]["error"]


async def _known(service: PlacementService, group: str) -> bool:
    return bool(service.fleet.group(group))


async def test_live_engines_artifact_health_and_metrics(bus: Bus, db_settings: SwitchyardSettings) -> None:
    await seed_engine_row(db_settings)
    async with api_server(db_settings) as api:
        await bus.publish(bus.subjects.hello("e0"), hello("e0", "g0", ["a", "b"]))
        telemetry = Telemetry(
            engine_id="e0",
            seq=7,
            ts=time.time(),
            kv_usage=0.4,
            num_running=3,
            num_waiting=1,
            waiting_prefill_tokens=10,
            remaining_prefill_tokens=5,
            step_time_ema=0.02,
        )
        await bus.publish(bus.subjects.telemetry("e0"), telemetry)

        async def live() -> list | None:
            engines = (await api.get("/v1/engines")).json()
            return engines if any(e["engine_id"] == "e0" and e["telemetry"] for e in engines) else None

        engines = {e["engine_id"]: e for e in await eventually(live)}
        assert engines["e0"]["live"] and not engines["e0"]["stale"] and engines["e0"]["telemetry"]["seq"] == 7
        assert engines["e0"]["gpus"] == ["a", "b"] and engines["e0"]["model"]["num_experts"] == EXPERTS
        assert not engines["old-e9"]["live"] and engines["old-e9"]["stale"]
        assert [e["engine_id"] for e in (await api.get("/v1/engines", params={"role": "decode"})).json()] == ["old-e9"]

        assert (await api.get("/v1/router/artifact")).status_code == 404
        kv = await bus.ensure_kv(bus.subjects.router_bucket)
        await kv.put(bus.subjects.artifact_key, encode(_artifact()))
        await kv.put(bus.subjects.artifact_key, b"garbage")  # finding 5: the last valid revision is shown
        meta = (await api.get("/v1/router/artifact")).json()
        assert (meta["version"], meta["idf_shape"], meta["centroids_shape"]) == (3, [2, 8], [4, 16])
        assert meta["idf"] is None and meta["centroids"] is None
        full = (await api.get("/v1/router/artifact", params={"include_arrays": "true"})).json()
        assert np.array(full["centroids"]).shape == (4, 16)

        ready = await api.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"nats": "ok", "database": "ok"}
        metrics = (await api.get("/metrics")).text
        assert 'switchyard_api_requests_total{route="/v1/engines",status="200"}' in metrics
        assert "/v1/placements/{placement_id}" in (await api.get("/openapi.json")).json()["paths"]


async def seed_engine_row(settings: SwitchyardSettings) -> None:
    engine, sessions = create_async_db(settings.resolved_database_url())
    async with sessions() as session, session.begin():
        session.add(old_engine())
    await engine.dispose()


def _artifact() -> RoutingArtifact:
    from switchyard.shared.artifact_hash import artifact_content_hash

    draft = RoutingArtifact(
        version=3,
        content_hash="ab" * 8,
        created_at=1.0,
        model=ModelShape(name="m", num_layers=4, num_experts=8, top_k=2),
        representation="count_idf",
        layer_mask=[1, 3],
        idf=np.full((2, 8), 0.5, np.float32),
        centroids=np.eye(4, 16, dtype=np.float32),
        rho=0.61,
    )
    return draft.model_copy(update={"content_hash": artifact_content_hash(draft)})  # the API checks it, as routers


def _fuzz(base_url: str) -> list[str]:
    """Run schemathesis over every operation, with valid and invalid inputs; a 5xx fails with its reproduction."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @hypothesis.settings(
                max_examples=20, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck)
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                auth = {"Authorization": f"Bearer {TOKEN}"}  # writes too, so their handlers are exercised
                case.call_and_validate(base_url=base_url, headers=auth, checks=[not_a_server_error])

            with contextlib.suppress(hypothesis.errors.Unsatisfiable):  # e.g. no invalid input for /healthz
                check()
            fuzzed.append(operation.label)
    return fuzzed


@pytest.mark.slow
async def test_schemathesis_finds_no_server_errors(
    bus: Bus, db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await seed(sessions)
    async with api_server(db_settings) as api:
        fuzzed = await asyncio.to_thread(_fuzz, str(api.base_url).rstrip("/"))
    assert len(set(fuzzed)) == 14  # every operation of the spec (expert-map: issue 40)


async def test_the_docs_pages_load_nothing_from_outside(db_settings: SwitchyardSettings) -> None:
    """/docs and /redoc name only scripts the API serves itself (an air-gapped cluster has no CDN), and serves them."""
    import re

    async with api_server(db_settings) as api:
        for page in ("/docs", "/redoc"):
            html = (await api.get(page)).text
            assets = re.findall(r'(?:src|href)="([^"]+)"', html)
            assert assets and not [a for a in assets if "://" in a or a.startswith("//")], (page, assets)
            for asset in assets:
                answer = await api.get(asset)
                assert answer.status_code == 200 and len(answer.content) > 1000, (page, asset)


async def test_engines_are_paged_and_requests_are_bounded(
    db_settings: SwitchyardSettings, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """Finding 6 and Deliver 4: 20,000 hellos made a 10.5 MB `/v1/engines`; a body declared as 1 GB was read."""
    async with sessions() as session, session.begin():
        for i in range(12):
            row = old_engine()
            row.engine_id = f"e{i:02d}"
            session.add(row)
    async with api_server(db_settings) as api:
        first = await api.get("/v1/engines", params={"limit": 5})
        assert first.status_code == 200 and len(first.json()) == 5
        assert first.headers["X-Total-Count"] == "12" and first.headers["X-Next-Offset"] == "5"
        last = await api.get("/v1/engines", params={"limit": 5, "offset": 10})
        assert [e["engine_id"] for e in last.json()] == ["e10", "e11"] and "X-Next-Offset" not in last.headers
        assert (await api.get("/v1/engines", params={"limit": 100_000})).status_code == 422  # page-size cap
        assert (await api.get("/v1/placements", params={"limit": 100_000})).status_code == 422
        from tests.test_http_limits import _exchange

        head = (
            f"POST /v1/calibrations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10**9}\r\nConnection: close\r\n\r\n"
        )
        status, _ = await _exchange(api.base_url.port, head, [b"{"])  # 1 GB declared: refused unread
        assert status == 413


async def test_engine_ingest_has_its_own_connection(bus: Bus, db_settings: SwitchyardSettings) -> None:
    """Finding 3: a flood on the engines' wildcard subjects made nats-server cut the API off as a slow consumer.
    Its fleet view (hellos, telemetry) is on a connection of its own: losing it leaves /v1/engines answering with
    the last view, and the writes (a calibration request on the stream) and artifact reads on the control one."""
    app = create_app(db_settings, ApiSettings(token=TOKEN))
    async with app.router.lifespan_context(app):
        state = app.state.switchyard
        assert state.ingest is not None and state.ingest.nc is not state.bus.nc
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api", timeout=10) as api:
            await bus.publish(bus.subjects.hello("e0"), hello("e0", "g0", ["a", "b"]))

            async def live() -> list | None:
                engines = (await api.get("/v1/engines")).json()
                return engines if any(e["engine_id"] == "e0" for e in engines) else None

            await eventually(live)
            await state.ingest.nc.close()  # what the server does to a slow consumer
            engines = await api.get("/v1/engines")
            auth = {"Authorization": f"Bearer {TOKEN}"}
            asked = await api.post("/v1/calibrations", headers=auth, json={"engine_group": "g0"})
            artifact = await api.get("/v1/router/artifact")
            ready = await api.get("/readyz")
    assert engines.status_code == 200 and "e0" in {e["engine_id"] for e in engines.json()}
    assert asked.status_code < 300, asked.text
    subject = bus.subjects.calibration_request
    stored = decode((await bus.js.get_last_msg(bus.subjects.placement_stream, subject)).data, CalibrationRequest)
    assert stored.request_id == asked.json()["request_id"]  # published on the control connection
    assert artifact.status_code == 404  # the KV was asked (and holds none), not a 5xx
    assert ready.status_code == 200 and ready.json()["checks"]["nats"] == "ok"
