"""outbox: a partial index of the pending deliveries, autovacuum tuned for the churn

Revision ID: 0002_publish
Revises: 0001
Create Date: 2026-11-22 01:00:00

The relay claims `state = 'pending' AND next_attempt_at <= now ORDER BY
next_attempt_at, id LIMIT n`. A partial index on the pending rows only stays as
small as the backlog (not the whole history of deliveries) and serves that
order directly; it replaces the (state, next_attempt_at) index, which every
claim and settlement had to update as well. Each delivery row is inserted once
and updated twice, so on PostgreSQL autovacuum runs on the outbox tables long
before the default 20 % of dead rows.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_publish"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING = sa.text("state = 'pending'")


def upgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_state_next_attempt")
    op.create_index(
        "ix_deliveries_pending_due",
        "deliveries",
        ["next_attempt_at", "id"],
        unique=False,
        postgresql_where=PENDING,
    )
    for table in ("deliveries", "events"):
        op.execute(
            f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0.02, "
            "autovacuum_analyze_scale_factor = 0.02)"
        )


def downgrade() -> None:
    for table in ("deliveries", "events"):
        op.execute(
            f"ALTER TABLE {table} RESET (autovacuum_vacuum_scale_factor, "
            "autovacuum_analyze_scale_factor)"
        )
    op.drop_index("ix_deliveries_pending_due", table_name="deliveries")
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_deliveries_state_next_attempt", ["state", "next_attempt_at"], unique=False
        )
