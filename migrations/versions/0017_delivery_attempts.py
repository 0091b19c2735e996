"""delivery attempts: what each copy's attempts came to, why it was given up, and a second
webhook secret while a rotation's window lasts

Revision ID: 0017_delivery_attempts
Revises: 0016_access_changes
Create Date: 2026-12-07 06:00:00.000000

Contract §14, "deliveries" and "rotating a webhook secret"
(docs/decisions/031-delivery-log.md). Each copy keeps its last 20 attempts (`attempt_log`,
appended by the statement that settles the attempt), the last one's time and status, and
a code for why it was given up (`given_up_reason`; `last_error` keeps the sentence). A
consumer's copies are listed newest first through `ix_deliveries_consumer_copies`
(consumer, id), which replaces the index on the consumer alone: one index, not two, on
the accept path's insert; the few copies given up have a partial index of their own. A webhook consumer keeps its previous secret until
`webhook_previous_until` after a rotation.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017_delivery_attempts"
down_revision: str | None = "0016_access_changes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        "deliveries",
        sa.Column(
            "attempt_log",
            postgresql.JSONB(),
            nullable=False,
            server_default=sa.text("'[]'::jsonb"),
        ),
    )
    op.add_column("deliveries", sa.Column("last_attempt_at", _TS, nullable=True))
    op.add_column("deliveries", sa.Column("last_status", sa.String(16), nullable=True))
    op.add_column("deliveries", sa.Column("given_up_reason", sa.String(32), nullable=True))
    op.create_index(
        "ix_deliveries_consumer_copies", "deliveries", ["consumer_uuid", "id"], unique=False
    )
    op.drop_index("ix_deliveries_consumer_uuid", table_name="deliveries")
    # The few copies given up, per consumer: `?state=given_up` without reading the rest.
    op.create_index(
        "ix_deliveries_consumer_given_up",
        "deliveries",
        ["consumer_uuid", "id"],
        unique=False,
        postgresql_where=sa.text("state IN ('given_up', 'rejected')"),
    )
    op.add_column(
        "event_consumers", sa.Column("webhook_previous_secret", sa.String(128), nullable=True)
    )
    op.add_column("event_consumers", sa.Column("webhook_previous_until", _TS, nullable=True))


def downgrade() -> None:
    op.drop_column("event_consumers", "webhook_previous_until")
    op.drop_column("event_consumers", "webhook_previous_secret")
    op.create_index("ix_deliveries_consumer_uuid", "deliveries", ["consumer_uuid"], unique=False)
    op.drop_index("ix_deliveries_consumer_given_up", table_name="deliveries")
    op.drop_index("ix_deliveries_consumer_copies", table_name="deliveries")
    op.drop_column("deliveries", "given_up_reason")
    op.drop_column("deliveries", "last_status")
    op.drop_column("deliveries", "last_attempt_at")
    op.drop_column("deliveries", "attempt_log")
