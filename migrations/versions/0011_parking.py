"""deliveries: parked_at, replay, and an index of each queue's parked copies

Revision ID: 0011_parking
Revises: 0010_presence
Create Date: 2026-11-26 12:40:00.000000

Contract §11: a copy for a queue whose agent is away is parked in the outbox and released
in acceptance order when a consumer returns (docs/decisions/015-parking.md); a replay's
copies are marked so the relay adds `x-queuekeeper-replay`.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_parking"
down_revision: str | None = "0010_presence"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PARKED_OR_RELEASING = "parked_at IS NOT NULL AND state IN ('parked', 'pending')"


def upgrade() -> None:
    with op.batch_alter_table("deliveries") as batch:
        batch.add_column(sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(
            sa.Column("replay", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.create_index(
        "ix_deliveries_parked",
        "deliveries",
        ["vhost", "queue_name", "state", "id"],
        postgresql_where=sa.text(PARKED_OR_RELEASING),
    )


def downgrade() -> None:
    op.drop_index("ix_deliveries_parked", table_name="deliveries")
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_column("replay")
        batch.drop_column("parked_at")
