"""delivered by owner: when a queue's or a consumer's copy was last confirmed, from an index

Revision ID: 0018_delivered_by_owner
Revises: 0017_delivery_attempts
Create Date: 2026-12-08 06:00:00.000000

A consumer's answer and a queue's `/status/` say when the broker last confirmed a copy for
it (`last_delivered_at`). Found as a max over the owner's delivered copies, it read every
one of them: 0.2 s for a consumer with a million copies on an idle machine, over a second
on a busy one. `ix_deliveries_delivered` holds the delivered copies by owner (the
subscription queue's uuid or the consumer's, as the status groups them) and `finished`,
so the max is the last entry of the owner's range (docs/decisions/031-delivery-log.md).
A copy enters it when it is settled as published, the statement that already rewrites
the index entries of the copy (its state changes, so the row is never updated in place).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_delivered_by_owner"
down_revision: str | None = "0017_delivery_attempts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_deliveries_delivered",
        "deliveries",
        [sa.text("coalesce(queue_uuid, consumer_uuid)"), "finished"],
        unique=False,
        postgresql_where=sa.text("state = 'published'"),
    )


def downgrade() -> None:
    op.drop_index("ix_deliveries_delivered", table_name="deliveries")
