"""history tables

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 12:45:11.200884
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _create_calibrations()
    _create_engines()
    _create_placements()
    _create_routing_artifacts()
    _create_migrations()
    _create_placement_assignments()
    _create_migration_moves()


def _create_calibrations() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("engine_group", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("beta", sa.Float(), nullable=False),
        sa.Column("gamma", sa.Float(), nullable=False),
        sa.Column("agreement", sa.Float(), nullable=False),
        sa.Column("comm_gap", sa.Float(), nullable=False),
        sa.Column("solve_seconds", sa.Float(), nullable=False),
        sa.Column("num_windows", sa.Integer(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.CheckConstraint("status IN ('running', 'succeeded', 'failed')", name="ck_calibrations_status"),
        sa.PrimaryKeyConstraint("id"),
    )


def _create_engines() -> None:
    op.create_table(
        "engines",
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("ep_group", sa.String(length=64), nullable=False),
        sa.Column("agent", sa.String(length=16), nullable=False),
        sa.Column("model_name", sa.String(length=128), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_experts", sa.Integer(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hello", sa.JSON(), nullable=False),
        sa.CheckConstraint("role IN ('prefill', 'decode', 'dp')", name="ck_engines_role"),
        sa.PrimaryKeyConstraint("engine_id"),
    )
    with op.batch_alter_table("engines", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_engines_ep_group"), ["ep_group"], unique=False)


def _create_placements() -> None:
    op.create_table(
        "placements",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("plan_id", sa.String(length=64), nullable=False),
        sa.Column("engine_group", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=True),
        sa.Column("parent_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("beta", sa.Float(), nullable=False),
        sa.Column("gamma", sa.Float(), nullable=False),
        sa.Column("objective_load", sa.Float(), nullable=False),
        sa.Column("objective_comm", sa.Float(), nullable=False),
        sa.Column("objective_mig", sa.Float(), nullable=False),
        sa.Column("objective_total", sa.Float(), nullable=False),
        sa.Column("predicted_gain", sa.Float(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=True),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_gpus", sa.Integer(), nullable=False),
        sa.Column("slots_per_gpu", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.CheckConstraint("source IN ('greedy', 'minlp', 'manual', 'rollback')", name="ck_placements_source"),
        sa.CheckConstraint(
            "status IN ('proposed', 'published', 'applied', 'superseded', 'rejected', 'failed')",
            name="ck_placements_status",
        ),
        sa.ForeignKeyConstraint(["parent_id"], ["placements.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("engine_group", "version", name="uq_placements_group_version"),
        sa.UniqueConstraint("plan_id"),
    )
    with op.batch_alter_table("placements", schema=None) as batch_op:
        batch_op.create_index("ix_placements_group_created", ["engine_group", "created_at"], unique=False)


def _create_routing_artifacts() -> None:
    op.create_table(
        "routing_artifacts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("representation", sa.String(length=32), nullable=False),
        sa.Column("tau", sa.Float(), nullable=False),
        sa.Column("rho", sa.Float(), nullable=False),
        sa.Column("num_decoders", sa.Integer(), nullable=False),
        sa.Column("layer_mask", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("version"),
    )
    with op.batch_alter_table("routing_artifacts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_routing_artifacts_content_hash"), ["content_hash"], unique=False)


def _create_migrations() -> None:
    op.create_table(
        "migrations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("placement_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("engine_group", sa.String(length=64), nullable=False),
        sa.Column("plan_version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'succeeded', 'failed', 'rolling_back', 'rolled_back', 'refused')",
            name="ck_migrations_state",
        ),
        sa.ForeignKeyConstraint(["placement_id"], ["placements.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("placement_id"),
    )
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_migrations_engine_group"), ["engine_group"], unique=False)


def _create_placement_assignments() -> None:
    op.create_table(
        "placement_assignments",
        sa.Column("placement_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("expert", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["placement_id"], ["placements.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("placement_id", "layer", "gpu", "slot"),
    )


def _create_migration_moves() -> None:
    op.create_table(
        "migration_moves",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("migration_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("expert", sa.Integer(), nullable=False),
        sa.Column("src_gpu", sa.Integer(), nullable=False),
        sa.Column("src_slot", sa.Integer(), nullable=False),
        sa.Column("dst_gpu", sa.Integer(), nullable=False),
        sa.Column("dst_slot", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'sent', 'applied', 'failed', 'rolled_back')",
            name="ck_migration_moves_state",
        ),
        sa.ForeignKeyConstraint(["migration_id"], ["migrations.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("migration_id", "seq", name="uq_migration_moves_seq"),
    )


def downgrade() -> None:
    op.drop_table("migration_moves")
    op.drop_table("placement_assignments")
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_migrations_engine_group"))

    op.drop_table("migrations")
    with op.batch_alter_table("routing_artifacts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_routing_artifacts_content_hash"))

    op.drop_table("routing_artifacts")
    with op.batch_alter_table("placements", schema=None) as batch_op:
        batch_op.drop_index("ix_placements_group_created")

    op.drop_table("placements")
    with op.batch_alter_table("engines", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_engines_ep_group"))

    op.drop_table("engines")
    op.drop_table("calibrations")
