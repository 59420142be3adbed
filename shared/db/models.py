"""The history tables of DESIGN.md. Every change goes through an Alembic migration in `shared/db/migrations/`.

Placements are append-only (a rollback is a new placement whose source is `rollback`); a migration row and
its move rows are the durable state machine the migration service resumes from after a restart.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from switchyard.shared.db.types import UTCDateTime, utcnow

PLACEMENT_SOURCES = ("greedy", "minlp", "manual", "rollback")
PLACEMENT_STATES = ("proposed", "published", "applied", "superseded", "rejected", "failed")
MIGRATION_STATES = ("pending", "running", "succeeded", "failed", "rolling_back", "rolled_back", "refused")
MOVE_STATES = ("pending", "sent", "applied", "failed", "rolled_back")
#: A forward move takes the group towards the plan; a rollback move undoes an applied forward step.
MOVE_KINDS = ("forward", "rollback")

#: Integer primary keys: BIGINT on PostgreSQL, INTEGER (the rowid alias, so autoincrement works) on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def _one_of(column: str, values: tuple[str, ...], name: str) -> CheckConstraint:
    listed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({listed})", name=name)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[Any]: JSON}


class Engine(Base):
    """Every engine that ever said hello; `last_seen` is refreshed by its hellos."""

    __tablename__ = "engines"

    engine_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    ep_group: Mapped[str] = mapped_column(String(64), index=True)
    agent: Mapped[str] = mapped_column(String(16))
    model_name: Mapped[str] = mapped_column(String(128))
    num_layers: Mapped[int]
    num_experts: Mapped[int]
    top_k: Mapped[int]
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
    hello: Mapped[dict[str, Any]] = mapped_column(default=dict)

    __table_args__ = (_one_of("role", ("prefill", "decode", "dp"), "ck_engines_role"),)


class RoutingArtifactRow(Base):
    """Every ELDR routing artifact ever fitted; `payload` is its exact wire encoding."""

    __tablename__ = "routing_artifacts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(unique=True)
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    representation: Mapped[str] = mapped_column(String(32))
    tau: Mapped[float] = mapped_column(Float)
    rho: Mapped[float] = mapped_column(Float)
    num_decoders: Mapped[int]
    layer_mask: Mapped[list[Any]]
    source: Mapped[str] = mapped_column(String(32), default="fit")
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    report: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Placement(Base):
    """One versioned expert placement of an engine group, with the objective terms that justified it."""

    __tablename__ = "placements"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    plan_id: Mapped[str] = mapped_column(String(64), unique=True)
    engine_group: Mapped[str] = mapped_column(String(64))
    version: Mapped[int]
    base_version: Mapped[int | None]
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("placements.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    source: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="proposed")
    #: The greedy's multiplier of each objective term (`PlacementPlan.params.weights`), by term name.
    params: Mapped[dict[str, Any]]
    #: Each objective term's value (`PlacementPlan.objective.terms`), by term name; the weighted sum beside it.
    objective_terms: Mapped[dict[str, Any]]
    objective_total: Mapped[float] = mapped_column(Float)
    predicted_gain: Mapped[float] = mapped_column(Float, default=0.0)
    #: Step time (s) the plan's layout was predicted to save over the horizon until the next plan, and what its
    #: migration was predicted to cost (issue 40's publish rule); null without a step-time prediction.
    predicted_saving_s: Mapped[float | None] = mapped_column(Float)
    predicted_cost_s: Mapped[float | None] = mapped_column(Float)
    #: The same saving measured on the expert-load windows after the plan (null until the group is next planned).
    measured_saving_s: Mapped[float | None] = mapped_column(Float)
    window_start: Mapped[datetime | None]
    window_end: Mapped[datetime | None]
    num_layers: Mapped[int]
    num_gpus: Mapped[int]
    slots_per_gpu: Mapped[int]
    gpus: Mapped[list[Any]]
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)

    assignments: Mapped[list[PlacementAssignment]] = relationship(
        back_populates="placement", cascade="all, delete-orphan", passive_deletes=True
    )

    __table_args__ = (
        UniqueConstraint("engine_group", "version", name="uq_placements_group_version"),
        Index("ix_placements_group_created", "engine_group", "created_at"),
        _one_of("source", PLACEMENT_SOURCES, "ck_placements_source"),
        _one_of("status", PLACEMENT_STATES, "ck_placements_status"),
    )


class PlacementAssignment(Base):
    """Which expert sits in which slot of which GPU, per layer (-1: empty slot)."""

    __tablename__ = "placement_assignments"

    placement_id: Mapped[int] = mapped_column(BigId, ForeignKey("placements.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(primary_key=True)
    gpu: Mapped[int] = mapped_column(primary_key=True)
    slot: Mapped[int] = mapped_column(primary_key=True)
    expert: Mapped[int]

    placement: Mapped[Placement] = relationship(back_populates="assignments")


class Migration(Base):
    """The execution of one placement on its engines; one per placement (idempotent by plan)."""

    __tablename__ = "migrations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    placement_id: Mapped[int] = mapped_column(BigId, ForeignKey("placements.id", ondelete="CASCADE"), unique=True)
    engine_group: Mapped[str] = mapped_column(String(64), index=True)
    plan_version: Mapped[int]
    #: The placement the group was in when the moves were planned (None: the default layout); rollback returns here.
    base_placement_id: Mapped[int | None] = mapped_column(BigId, ForeignKey("placements.id", ondelete="SET NULL"))
    state: Mapped[str] = mapped_column(String(16), default="pending")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)

    moves: Mapped[list[MigrationMove]] = relationship(
        back_populates="migration",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="MigrationMove.seq",
    )

    __table_args__ = (_one_of("state", MIGRATION_STATES, "ck_migrations_state"),)


class MigrationMove(Base):
    """One expert move of a migration and its result; `seq` is the execution order."""

    __tablename__ = "migration_moves"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    migration_id: Mapped[int] = mapped_column(BigId, ForeignKey("migrations.id", ondelete="CASCADE"))
    seq: Mapped[int]
    step: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16), default="forward", server_default="forward")
    engine_id: Mapped[str] = mapped_column(String(64))
    layer: Mapped[int]
    expert: Mapped[int]
    src_gpu: Mapped[int]
    src_slot: Mapped[int]
    dst_gpu: Mapped[int]
    dst_slot: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    duration_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    migration: Mapped[Migration] = relationship(back_populates="moves")

    __table_args__ = (
        UniqueConstraint("migration_id", "seq", name="uq_migration_moves_seq"),
        _one_of("state", MOVE_STATES, "ck_migration_moves_state"),
        _one_of("kind", MOVE_KINDS, "ck_migration_moves_kind"),
    )


class Calibration(Base):
    """One offline MINLP calibration of the greedy's multipliers, by term (α, β, γ: comm, load, mig)."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    engine_group: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="succeeded")
    #: The fitted multiplier of each objective term, by term name (`GreedyParams.as_map()`).
    params: Mapped[dict[str, Any]]
    agreement: Mapped[float] = mapped_column(Float)
    comm_gap: Mapped[float] = mapped_column(Float)
    solve_seconds: Mapped[float] = mapped_column(Float)
    num_windows: Mapped[int]
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)

    # "running" is reserved: rows are written once a calibration has finished, so none is left half-done
    __table_args__ = (_one_of("status", ("running", "succeeded", "failed"), "ck_calibrations_status"),)
