"""agents 1.0.8 and client 8.1.3 (contract §10): fan-out events, consumers' token prefix

Revision ID: 0007_agents108
Revises: 0006_announce_due
Create Date: 2026-11-26 09:00:00.000000

- `events.offering_uuids`: the offerings of an event sent with `offering_uuids` (null for
  one offering);
- `deliveries.offering_uuid`: the offering of such an event's copy, which its body and
  headers carry (null: the event's offering);
- `event_consumers.auth_token_prefix`: the first characters of the token that registered
  the consumer (client 8.1.3's `EventConsumer.auth_token_prefix`).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_agents108"
down_revision: str | None = "0006_announce_due"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("events", sa.Column("offering_uuids", sa.JSON(), nullable=True))
    op.add_column("deliveries", sa.Column("offering_uuid", sa.Uuid(), nullable=True))
    op.add_column(
        "event_consumers",
        sa.Column("auth_token_prefix", sa.String(length=8), nullable=False, server_default=""),
    )


def downgrade() -> None:
    with op.batch_alter_table("event_consumers") as batch:
        batch.drop_column("auth_token_prefix")
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_column("offering_uuid")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("offering_uuids")
