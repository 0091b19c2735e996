"""webhook consumers: their URL, secret and delivery facts; webhook copies apart from the relay's

Revision ID: 0015_webhooks
Revises: 0014_event_keys
Create Date: 2026-11-28 15:00:00.000000

Contract §13: a consumer delivers by `rmq` (its queue) or `webhook` (an HTTP POST). A webhook
consumer's copies are outbox rows like any other, marked `webhook`: the queue relay's claim
reads pending copies through an index that leaves them out, and the webhook dispatcher reads
each consumer's oldest pending copy through an index of its own; the insert trigger of
0006 announces webhook copies on a channel of their own
(docs/decisions/026-webhooks-on-the-outbox.md).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_webhooks"
down_revision: str | None = "0014_event_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("event_consumers") as batch:
        batch.add_column(sa.Column("delivery", sa.String(8), nullable=False, server_default="rmq"))
        batch.add_column(sa.Column("webhook_url", sa.Text(), nullable=True))
        batch.add_column(sa.Column("webhook_secret", sa.String(128), nullable=True))
        batch.add_column(sa.Column("webhook_gone_at", _TS, nullable=True))
        batch.add_column(sa.Column("webhook_failing_since", _TS, nullable=True))
        batch.add_column(sa.Column("last_delivered_at", _TS, nullable=True))
        batch.add_column(sa.Column("last_error", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("last_error_at", _TS, nullable=True))
    with op.batch_alter_table("deliveries") as batch:
        batch.add_column(
            sa.Column("webhook", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.drop_index("ix_deliveries_pending_due", table_name="deliveries")
    op.create_index(
        "ix_deliveries_pending_due",
        "deliveries",
        ["next_attempt_at", "id"],
        postgresql_where=sa.text("state = 'pending' AND NOT webhook"),
    )
    op.create_index(
        "ix_deliveries_webhook_pending",
        "deliveries",
        ["consumer_uuid", "id"],
        postgresql_where=sa.text("state = 'pending' AND webhook"),
    )

    # Copies committed unclaimed are announced on two channels: the queue relay's (as
    # migration 0006 did, now for queue copies only) and the webhook dispatcher's, so
    # neither runs a claim for the other's copies (docs/decisions/026-webhooks-on-the-outbox.md).
    op.execute(
        """
        CREATE OR REPLACE FUNCTION queuekeeper_announce_due() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            consumers text;
        BEGIN
            IF EXISTS (SELECT 1 FROM inserted WHERE claimed_by IS NULL AND NOT webhook) THEN
                PERFORM pg_notify('queuekeeper_outbox_due', '');
            END IF;
            IF EXISTS (SELECT 1 FROM inserted WHERE webhook) THEN
                -- The consumers, so a dispatcher posting to them already claims nothing;
                -- '' (any) when they would not fit a notification's payload.
                SELECT string_agg(DISTINCT consumer_uuid::text, ',') INTO consumers
                FROM inserted WHERE webhook;
                PERFORM pg_notify(
                    'queuekeeper_webhooks_due',
                    CASE WHEN length(consumers) < 7000 THEN consumers ELSE '' END
                );
            END IF;
            RETURN NULL;
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute(
        """
        CREATE OR REPLACE FUNCTION queuekeeper_announce_due() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM inserted WHERE claimed_by IS NULL) THEN
                PERFORM pg_notify('queuekeeper_outbox_due', '');
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    op.drop_index("ix_deliveries_webhook_pending", table_name="deliveries")
    op.drop_index("ix_deliveries_pending_due", table_name="deliveries")
    op.execute("DELETE FROM deliveries WHERE webhook")
    op.execute("DELETE FROM event_consumers WHERE delivery = 'webhook'")
    op.create_index(
        "ix_deliveries_pending_due",
        "deliveries",
        ["next_attempt_at", "id"],
        postgresql_where=sa.text("state = 'pending'"),
    )
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_column("webhook")
    with op.batch_alter_table("event_consumers") as batch:
        for column in (
            "last_error_at",
            "last_error",
            "last_delivered_at",
            "webhook_failing_since",
            "webhook_gone_at",
            "webhook_secret",
            "webhook_url",
            "delivery",
        ):
            batch.drop_column(column)
