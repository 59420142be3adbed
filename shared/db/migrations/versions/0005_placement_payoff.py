"""placement payoff: the step time a plan was predicted to save and to cost, and the saving measured after it

The placement service publishes a plan only when the step time its layout saves over the horizon until the
next plan beats the step time its migration costs (issue 40). Both predictions are written with the plan, in
the same transaction; the saving measured on the expert-load windows that came after the plan is written once
the group is next planned, so the prediction can be checked. All three are seconds of serving time; null on
rows written before, on plans without a step-time prediction (manual, rollback) and until measured.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-09 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("predicted_saving_s", "predicted_cost_s", "measured_saving_s")


def upgrade() -> None:
    with op.batch_alter_table("placements", schema=None) as batch_op:
        for name in _COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("placements", schema=None) as batch_op:
        for name in reversed(_COLUMNS):
            batch_op.drop_column(name)
