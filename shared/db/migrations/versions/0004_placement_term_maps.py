"""placement term maps: the greedy's multipliers and the objective's terms as name→value JSON maps

Placements and calibrations carried three fixed columns for the greedy's multipliers (alpha, beta, gamma)
and placements three for the objective's terms (objective_load, _comm, _mig); a new objective term would
have needed a column in each table and a migration. They become JSON maps keyed by term name (`params`,
`objective_terms`): alpha, beta, gamma are the multipliers of comm, load and mig. Existing rows are
copied across, so every old row still reads; the downgrade copies the three built-in terms back (a term
added since has no column to go to and is dropped).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: old column → key of the map it moves into, per table and map
_PARAMS = {"alpha": "comm", "beta": "load", "gamma": "mig"}
_OBJECTIVE = {"objective_load": "load", "objective_comm": "comm", "objective_mig": "mig"}
_MAPS = {"placements": {"params": _PARAMS, "objective_terms": _OBJECTIVE}, "calibrations": {"params": _PARAMS}}


def _table(name: str, maps: dict[str, dict[str, str]]) -> sa.TableClause:
    columns = [sa.Column("id", sa.Integer, primary_key=True)]
    columns += [sa.Column(m, sa.JSON) for m in maps]
    columns += [sa.Column(old, sa.Float) for fields in maps.values() for old in fields]
    return sa.table(name, *columns)


def upgrade() -> None:
    bind = op.get_bind()
    for name, maps in _MAPS.items():
        with op.batch_alter_table(name, schema=None) as batch_op:
            for m in maps:
                batch_op.add_column(sa.Column(m, sa.JSON(), nullable=True))
        table = _table(name, maps)
        old = [table.c[o] for fields in maps.values() for o in fields]
        for row in bind.execute(sa.select(table.c.id, *old)).mappings().all():
            values = {m: {key: row[o] for o, key in fields.items()} for m, fields in maps.items()}
            bind.execute(sa.update(table).where(table.c.id == row["id"]).values(**values))
        with op.batch_alter_table(name, schema=None) as batch_op:
            for m in maps:
                batch_op.alter_column(m, existing_type=sa.JSON(), nullable=False)
            for fields in maps.values():
                for o in fields:
                    batch_op.drop_column(o)


def downgrade() -> None:
    bind = op.get_bind()
    for name, maps in _MAPS.items():
        with op.batch_alter_table(name, schema=None) as batch_op:
            for fields in maps.values():
                for o in fields:
                    batch_op.add_column(sa.Column(o, sa.Float(), nullable=True))
        table = _table(name, maps)
        for row in bind.execute(sa.select(table.c.id, *(table.c[m] for m in maps))).mappings().all():
            values = {o: float((row[m] or {}).get(key, 0.0)) for m, fields in maps.items() for o, key in fields.items()}
            bind.execute(sa.update(table).where(table.c.id == row["id"]).values(**values))
        with op.batch_alter_table(name, schema=None) as batch_op:
            for fields in maps.values():
                for o in fields:
                    batch_op.alter_column(o, existing_type=sa.Float(), nullable=False)
            for m in maps:
                batch_op.drop_column(m)
