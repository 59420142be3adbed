"""migration rollback state: the base placement of a migration, and forward/rollback move kinds

A migration that fails part-way rolls back to the placement it started from, possibly after a restart, so
that base is stored rather than inferred; rollback moves live beside the forward ones in `migration_moves`
and are told apart by `kind`.

Revision ID: 0003
Revises: 0001
Create Date: 2026-12-01 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("base_placement_id", _ID, nullable=True))
        batch_op.create_foreign_key(
            "fk_migrations_base_placement_id_placements",
            "placements",
            ["base_placement_id"],
            ["id"],
            ondelete="SET NULL",
        )
    with op.batch_alter_table("migration_moves", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), server_default="forward", nullable=False))
        batch_op.create_check_constraint("ck_migration_moves_kind", "kind IN ('forward', 'rollback')")


def downgrade() -> None:
    with op.batch_alter_table("migration_moves", schema=None) as batch_op:
        batch_op.drop_constraint("ck_migration_moves_kind", type_="check")
        batch_op.drop_column("kind")
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.drop_constraint("fk_migrations_base_placement_id_placements", type_="foreignkey")
        batch_op.drop_column("base_placement_id")
