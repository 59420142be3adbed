"""Fixtures that give every test real infrastructure: a private nats-server and real databases.

- `nats_url`: one embedded nats-server (JetStream on) for the whole session, on a free loopback port. Under
  pytest-xdist (`make test`'s parallel part) a session is one worker, so each worker has its own server, its own
  temp folders (`tmp_path`) and its own PostgreSQL databases (named with the worker's id).
- `settings`: settings pointing at it, with a subject prefix unique to the test, so tests never see each
  other's traffic even on one server.
- `bus`: a connected `shared.bus.Bus` for those settings.
- `database_url`: parametrised over SQLite (a temp file) and PostgreSQL (a fresh database created for the
  test session on the server named by SWITCHYARD_TEST_DATABASE_URL, or the local default server). Without
  a reachable PostgreSQL the PostgreSQL cases skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from switchyard.data import SHIPPED_DIR
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.settings import SwitchyardSettings

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
#: The traces shipped inside the package (`switchyard.data`), the same ones the CLI defaults use.
SHIPPED_DATA = SHIPPED_DIR


def _postgres_admin_url() -> str | None:
    """The server to create test databases on, or None if none is reachable."""
    candidates = [os.environ.get("SWITCHYARD_TEST_DATABASE_URL"), LOCAL_POSTGRES]
    for url in filter(None, candidates):
        try:
            engine = create_engine(
                make_url(url).set(drivername="postgresql+psycopg"), connect_args={"connect_timeout": 3}
            )
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            engine.dispose()
            return url
        except Exception:
            continue
    return None


#: Fixtures that start a server or reach one: a test using any of them is marked `infra`.
INFRA_FIXTURES = frozenset(
    {"nats_server", "nats_url", "settings", "bus", "database_url", "postgres_admin_url", "secured"}
)
#: A test module whose source names one of these starts processes of its own: all its tests are marked `infra`.
PROCESS_WORDS = ("subprocess", "create_subprocess_exec", "Popen", "EmbeddedNats(", "uvicorn", "serving_asgi")


#: Tests whose assertions race the clock or the CPU (kills and takeovers timed against leases, floods, outages,
#: budgets per second, memory counts under load): `make test` runs them `serial`, after the parallel part, with
#: the machine to themselves. A whole module by file name, or one test as "file::name".
SERIAL = {
    "test_chaos_attacks.py": "chaos: faults injected into live processes, recovery timed",
    "test_chaos_recovery.py": "chaos: kill/restart cycles, recovery timed",
    "test_live_fleet.py": "the whole fleet as processes, converging within deadlines",
    "test_placement_takeover.py": "kill -9 of the active replica, takeover timed against the lease",
    "test_migration_takeover.py": "kill -9 of the active replica, takeover timed against the lease",
    "test_migration_sigkill.py": "SIGKILL mid-migration, resumption timed",
    "test_replica_kill.py": "kill -9 of routers / gateways under load",
    "test_gateway_kill_streams.py": "a gateway killed while streaming, the client's view timed",
    "test_nats_cluster.py": "a NATS cluster node restarted, reconnection timed",
    "test_announce_flood.py": "floods from processes against rate budgets",
    "test_database_outage.py": "an 8 s PostgreSQL outage, resumption within 5 s",
    "test_memory_bounds.py": "floods of hostile values, liveness between bursts (fresh_load_s)",
    "test_hostile_input.py": "every variant on every subject, no service may stall past a deadline",
    "test_liveness.py::test_router_gateway_and_fleet_view_drop_a_silent_engine_together": (
        "three views must drop a silent engine within 1 s of each other"
    ),
    "test_migration_service.py::test_a_nats_restart_mid_step_resends_at_once_not_after_the_step_timeout": (
        "counts resends across a NATS restart; a slow reconnect under load adds one (seen at -n 4)"
    ),
    "test_cli_up.py::test_up_stops_on_signal_with_no_process_left": (
        "the whole control plane must stop within 30 s of a signal (timed out at -n 4 on a loaded machine)"
    ),
    "test_cli_up.py::test_killed_up_takes_its_nats_server_and_gateway_with_it": (
        "its children must be gone within 15 s of the kill"
    ),
    "test_epp.py::test_shedding_answers_429": (
        "sheds while a 10 s stream is still running; at -n 4 the stream had ended first (200, not 429)"
    ),
    "test_gateway_sessions.py::test_a_forged_binding_never_pins_a_session_on_a_saturated_engine": (
        "holds an engine saturated while it asks; at -n 4 a request timed out (httpx.ReadTimeout)"
    ),
}


def _serial(item: pytest.Item) -> bool:
    name = item.path.name
    return name in SERIAL or f"{name}::{getattr(item, 'originalname', item.name)}" in SERIAL


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts servers or processes `infra`, so `make test-fast` (`-m "not infra"`) runs the
    pure ones: solver, simulator, policies, parsers; and the timing-sensitive ones `serial` (`SERIAL`)."""
    spawning: dict[Path, bool] = {}
    for item in items:
        if _serial(item):
            item.add_marker(pytest.mark.serial)
        path = Path(str(item.fspath))
        if path not in spawning:
            source = path.read_text(errors="replace") if path.is_file() else ""
            spawning[path] = any(word in source for word in PROCESS_WORDS)
        if spawning[path] or INFRA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.infra)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Under CI=true a skip is a failure: CI must exercise every test (data and servers are its job).

    The one exception is the real-vLLM tests (`test_vllm_*.py`), which skip in the light environment of
    `make test` by design; `make test-vllm` sets SWITCHYARD_REQUIRE_VLLM=1, and there they must run too.
    """
    outcome = yield
    report = outcome.get_result()
    vllm_optional = item.path.name.startswith("test_vllm_") and os.environ.get("SWITCHYARD_REQUIRE_VLLM") != "1"
    if report.skipped and os.environ.get("CI") == "true" and not vllm_optional:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true: this test skipped ({reason}); under CI every test must run"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """The same rule for a whole module skipped at import (`pytest.importorskip` at module level)."""
    outcome = yield
    report = outcome.get_result()
    path = getattr(collector, "path", None)
    if not report.skipped or os.environ.get("CI") != "true" or path is None or not path.name.startswith("test_"):
        return
    if path.name.startswith("test_vllm_") and os.environ.get("SWITCHYARD_REQUIRE_VLLM") != "1":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"CI=true: this module skipped ({reason}); under CI every test must run"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def settings(nats_url: str, tmp_path: Path) -> SwitchyardSettings:
    prefix = "t" + uuid.uuid4().hex[:10]
    return SwitchyardSettings(
        nats_servers=[nats_url], subject_prefix=prefix, data_dir=tmp_path / "data", nats_initial_connect_s=5.0
    )


@pytest.fixture
async def bus(settings: SwitchyardSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, name="test")
    yield b
    await _delete_jetstream_state(b)
    await b.close()


async def _delete_jetstream_state(b: Bus) -> None:
    """Drop the test's streams and KV bucket, so a long session does not pile up JetStream state on disk.

    Housekeeping, not a check: a server still busy after a test that killed or flooded things may not answer a
    delete in time (the names are the test's own prefix, so what is left costs only disk until the session ends)."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    for name in [*b.subjects.streams(), f"KV_{b.subjects.router_bucket}", f"KV_{b.subjects.lease_bucket}"]:
        with contextlib.suppress(NotFoundError, NatsTimeout):
            await b.js.delete_stream(name)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """A reachable PostgreSQL server to create throw-away databases on."""
    admin = _postgres_admin_url()
    if admin is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no PostgreSQL is reachable (set SWITCHYARD_TEST_DATABASE_URL)")
        pytest.skip("no PostgreSQL reachable; set SWITCHYARD_TEST_DATABASE_URL to run these")
    return admin


@contextlib.contextmanager
def fresh_postgres_database(admin_url: str) -> Iterator[str]:
    """Create an empty database on the server, yield its URL, drop it afterwards."""
    admin = make_url(admin_url)
    engine = create_engine(admin.set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    # The xdist worker's id ("gw0", ...) in the name says whose database a leftover is; the uuid keeps it unique.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"switchyard_test_{worker}_{uuid.uuid4().hex[:10]}"
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no tables) on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.sqlite'}"
        return
    with fresh_postgres_database(request.getfixturevalue("postgres_admin_url")) as url:
        yield url
