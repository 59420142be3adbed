"""History tables and Alembic migrations, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from switchyard.shared.db import (
    Base,
    Calibration,
    Migration,
    MigrationMove,
    Placement,
    PlacementAssignment,
    create_async_db,
    downgrade,
    sync_url,
    upgrade,
)
from switchyard.shared.db.engine import _ensure_wal, current_revision

TABLES = {
    "engines",
    "routing_artifacts",
    "placements",
    "placement_assignments",
    "migrations",
    "migration_moves",
    "calibrations",
}


def _tables(url: str) -> set[str]:
    engine = create_engine(sync_url(url))
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_then_downgrade_round_trips(database_url: str) -> None:
    assert _tables(database_url) == set()
    upgrade(database_url)
    assert _tables(database_url) == TABLES
    assert current_revision(database_url) is not None
    upgrade(database_url)  # idempotent
    downgrade(database_url, "base")
    assert _tables(database_url) == set()
    assert current_revision(database_url) is None
    upgrade(database_url)
    assert _tables(database_url) == TABLES


def test_migrations_match_the_models(database_url: str) -> None:
    upgrade(database_url)
    engine = create_engine(sync_url(database_url))
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert diff == []


def _placement(version: int, **kw: object) -> Placement:
    fields = dict(
        plan_id=f"plan-{version}",
        engine_group="g0",
        version=version,
        source="greedy",
        params={"comm": 1.0, "load": 0.0025, "mig": 1.0},
        objective_terms={"load": 1.0, "comm": 2.0, "mig": 0.5},
        objective_total=3.5,
        num_layers=2,
        num_gpus=2,
        slots_per_gpu=2,
        gpus=["gpu0", "gpu1"],
    )
    fields.update(kw)
    return Placement(**fields)


async def test_history_rows_behave_identically(database_url: str) -> None:
    upgrade(database_url)
    engine, sessions = create_async_db(database_url)
    when = datetime(2026, 3, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    try:
        async with sessions() as session, session.begin():
            placement = _placement(1, created_at=when, details={"why": "drift", "layers": [1, 2]})
            placement.assignments = [
                PlacementAssignment(layer=layer, gpu=g, slot=k, expert=layer * 4 + g * 2 + k)
                for layer in range(2)
                for g in range(2)
                for k in range(2)
            ]
            session.add(placement)
            session.add(
                Calibration(
                    params={"comm": 1.0, "load": 0.0025, "mig": 1.0},
                    agreement=0.83,
                    comm_gap=0.004,
                    solve_seconds=12.5,
                    num_windows=4,
                )
            )
        async with sessions() as session:
            row = (await session.execute(select(Placement).where(Placement.version == 1))).scalar_one()
            assert row.created_at == when and row.created_at.tzinfo is not None
            assert row.created_at.utcoffset() == timedelta(0)  # always handed back in UTC
            assert row.details == {"why": "drift", "layers": [1, 2]}
            assignments = (
                (await session.execute(select(PlacementAssignment).where(PlacementAssignment.placement_id == row.id)))
                .scalars()
                .all()
            )
            assert sorted(a.expert for a in assignments) == list(range(8))
    finally:
        await engine.dispose()


async def test_constraints_hold_on_both_backends(database_url: str) -> None:
    upgrade(database_url)
    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session, session.begin():
            session.add(_placement(1))
        with pytest.raises(IntegrityError):  # (engine_group, version) is unique
            async with sessions() as session, session.begin():
                session.add(_placement(1, plan_id="other"))
        with pytest.raises(IntegrityError):  # source must be one of the known values
            async with sessions() as session, session.begin():
                session.add(_placement(2, source="guess"))
        with pytest.raises(IntegrityError):  # foreign keys are enforced (SQLite too)
            async with sessions() as session, session.begin():
                session.add(Migration(placement_id=999_999, engine_group="g0", plan_version=1))
    finally:
        await engine.dispose()


async def test_deleting_a_placement_cascades_to_its_migration_state(database_url: str) -> None:
    upgrade(database_url)
    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session, session.begin():
            placement = _placement(1)
            session.add(placement)
            await session.flush()
            migration = Migration(placement_id=placement.id, engine_group="g0", plan_version=1, state="running")
            migration.moves = [
                MigrationMove(
                    seq=i, step=0, engine_id="e0", layer=0, expert=i, src_gpu=0, src_slot=i, dst_gpu=1, dst_slot=i
                )
                for i in range(3)
            ]
            session.add(migration)
        async with sessions() as session, session.begin():
            await session.delete(await session.get(Placement, placement.id))
        async with sessions() as session:
            assert (await session.execute(select(MigrationMove))).scalars().all() == []
            assert (await session.execute(select(Migration))).scalars().all() == []
    finally:
        await engine.dispose()


def test_rows_from_before_term_maps_still_read_and_downgrade_back(database_url: str) -> None:
    """Revision 0004 moves the fixed alpha/beta/gamma and objective_* columns into term maps, row by row."""
    upgrade(database_url, "0003")
    engine = create_engine(sync_url(database_url))
    old_placement = (
        "INSERT INTO placements (plan_id, engine_group, version, created_at, source, status, alpha, beta, gamma, "
        "objective_load, objective_comm, objective_mig, objective_total, predicted_gain, num_layers, num_gpus, "
        "slots_per_gpu, gpus, details) VALUES ('old', 'g0', 1, '2026-03-01 12:00:00', 'greedy', 'applied', 1.0, "
        "0.0625, 2.0, 1.5, 2.5, 0.5, 79.0, 0.0, 1, 2, 2, '[\"a\", \"b\"]', '{}')"
    )
    old_calibration = (
        "INSERT INTO calibrations (created_at, status, alpha, beta, gamma, agreement, comm_gap, solve_seconds, "
        "num_windows, details) VALUES ('2026-03-01 12:00:00', 'succeeded', 1.0, 0.125, 1.5, 0.8, 0.01, 2.0, 3, '{}')"
    )
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(old_placement)
            connection.exec_driver_sql(old_calibration)
        upgrade(database_url)
        with Session(engine) as session:
            placement = session.scalars(select(Placement)).one()
            assert placement.params == {"comm": 1.0, "load": 0.0625, "mig": 2.0}
            assert placement.objective_terms == {"load": 1.5, "comm": 2.5, "mig": 0.5}
            assert placement.objective_total == 79.0
            assert session.scalars(select(Calibration)).one().params == {"comm": 1.0, "load": 0.125, "mig": 1.5}
        downgrade(database_url, "0003")
        with engine.connect() as connection:
            row = connection.exec_driver_sql("SELECT alpha, beta, gamma, objective_mig FROM placements").one()
            assert tuple(row) == (1.0, 0.0625, 2.0, 0.5)
            assert tuple(connection.exec_driver_sql("SELECT beta, gamma FROM calibrations").one()) == (0.125, 1.5)
    finally:
        engine.dispose()


def test_naive_datetimes_are_refused() -> None:
    from sqlalchemy.dialects import sqlite

    from switchyard.shared.db.types import UTCDateTime

    with pytest.raises(ValueError, match="naive"):
        UTCDateTime().process_bind_param(datetime(2026, 1, 1), sqlite.dialect())
    aware = UTCDateTime().process_bind_param(datetime(2026, 1, 1, tzinfo=UTC), sqlite.dialect())
    assert aware.tzinfo is None  # SQLite stores naive UTC text


def test_unsupported_database_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported database"):
        sync_url("mysql://root@localhost/x")


def test_switching_a_busy_sqlite_file_to_wal_waits_instead_of_failing(tmp_path: Path) -> None:
    """Services starting together on a new file: one held it while another switched it to WAL, and died."""
    path = tmp_path / "busy.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    release.start()
    other = sqlite3.connect(path, timeout=0.0)  # no busy wait: a locked file fails at once
    try:
        _ensure_wal(other.cursor())
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        release.join()
        other.close()
        holder.close()


def test_placements_from_before_the_payoff_columns_read_with_nulls_and_downgrade_back(database_url: str) -> None:
    """Revision 0005 adds the step-time predictions and the measured saving as nullable columns."""
    upgrade(database_url, "0004")
    engine = create_engine(sync_url(database_url))
    old_placement = (
        "INSERT INTO placements (plan_id, engine_group, version, created_at, source, status, params, "
        "objective_terms, objective_total, predicted_gain, num_layers, num_gpus, slots_per_gpu, gpus, details) "
        "VALUES ('old', 'g0', 1, '2026-03-01 12:00:00', 'greedy', 'applied', '{}', '{}', 1.0, 0.0, 1, 2, 2, "
        "'[\"a\", \"b\"]', '{}')"
    )
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(old_placement)
        upgrade(database_url)
        with Session(engine) as session:
            placement = session.scalars(select(Placement)).one()
            assert (placement.predicted_saving_s, placement.predicted_cost_s, placement.measured_saving_s) == (
                None,
                None,
                None,
            )
            placement.predicted_saving_s, placement.measured_saving_s = 1.5, 0.75
            session.commit()
        downgrade(database_url, "0004")
        with engine.connect() as connection:
            columns = {c["name"] for c in inspect(connection).get_columns("placements")}
            assert "measured_saving_s" not in columns and "predicted_saving_s" not in columns
            assert connection.exec_driver_sql("SELECT plan_id FROM placements").one()[0] == "old"
    finally:
        engine.dispose()
