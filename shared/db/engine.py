"""Database URLs, engines and schema migrations.

Users give plain URLs (`postgresql://user@host/db`, `sqlite:///path`); Switchyard picks the drivers:
psycopg 3 for PostgreSQL (sync and async), sqlite3/aiosqlite for SQLite. The schema is only ever created
by Alembic (`upgrade`), never by `create_all`, so production and tests run the same DDL. The migrations live
beside the models they migrate, in `migrations/` (env.py, script.py.mako, versions/): package data of
`switchyard.shared`, so nothing here reaches up to `infra` for them.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from switchyard.shared.errors import ConfigError

if TYPE_CHECKING:
    from alembic.config import Config

#: The Alembic script folder: env.py, script.py.mako and the revisions in versions/.
ALEMBIC_DIR = Path(__file__).resolve().parent / "migrations"


def _url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError("not a database URL: use postgresql://... or sqlite:///path") from exc
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise ConfigError(f"unsupported database {backend!r}: use postgresql://... or sqlite:///path")
    return parsed


def sync_url(url: str | URL) -> URL:
    parsed = _url(url)
    driver = "psycopg" if parsed.get_backend_name() == "postgresql" else "pysqlite"
    return parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")


def async_url(url: str | URL) -> URL:
    parsed = _url(url)
    driver = "psycopg" if parsed.get_backend_name() == "postgresql" else "aiosqlite"
    return parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Foreign keys are off by default in SQLite; WAL lets the API read while a service writes.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.execute("PRAGMA foreign_keys=ON")
        _ensure_wal(cursor)
    finally:
        cursor.close()


def _ensure_wal(cursor: Any, attempts: int = 100) -> None:
    """Put the database file in WAL mode (a persistent property of the file), unless it already is.

    Switching needs an exclusive lock and SQLite answers "database is locked" at once, without waiting for
    the busy timeout, when another connection holds the file. Services starting together on a new file did
    exactly that and one died at start; so check first, and retry the switch.
    """
    for attempt in range(attempts):
        try:
            cursor.execute("PRAGMA journal_mode")
            if str(cursor.fetchone()[0]).lower() == "wal":
                return
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


def ensure_sqlite_dir(url: URL) -> None:
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


def create_async_db(url: str | URL, **kwargs: Any) -> tuple[AsyncEngine, async_sessionmaker[Any]]:
    """An async engine and session factory for a plain database URL."""
    parsed = async_url(url)
    ensure_sqlite_dir(parsed)
    engine = create_async_engine(parsed, pool_pre_ping=True, **kwargs)
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine, async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | URL) -> Config:
    # Alembic is imported by the functions that migrate, not by every process that reads the history: a
    # restarted router must not wait for it (docs/reliability.md).
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(ALEMBIC_DIR))
    config.set_main_option("sqlalchemy.url", sync_url(url).render_as_string(hide_password=False).replace("%", "%%"))
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Bring the schema up to `revision` (idempotent); a SQLite file is also put in WAL mode, once."""
    parsed = sync_url(url)
    ensure_sqlite_dir(parsed)
    from alembic import command

    command.upgrade(alembic_config(url), revision)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        with contextlib.closing(sqlite3.connect(parsed.database, timeout=5.0)) as connection:
            _ensure_wal(connection.cursor())


def downgrade(url: str | URL, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str | URL) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
