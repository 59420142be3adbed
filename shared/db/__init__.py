"""History tables (SQLAlchemy 2) and engine/migration helpers; identical behaviour on SQLite and PostgreSQL."""

from switchyard.shared.db.engine import async_url, create_async_db, downgrade, sync_url, upgrade
from switchyard.shared.db.models import (
    Base,
    Calibration,
    Engine,
    Migration,
    MigrationMove,
    Placement,
    PlacementAssignment,
    RoutingArtifactRow,
)

__all__ = [
    "Base",
    "Calibration",
    "Engine",
    "Migration",
    "MigrationMove",
    "Placement",
    "PlacementAssignment",
    "RoutingArtifactRow",
    "async_url",
    "create_async_db",
    "downgrade",
    "sync_url",
    "upgrade",
]
