"""unified event consumers: one queue per agent identity (waldur-site-agent 1.0.7, contract §9)

Revision ID: 0005_consumers
Revises: 0004_agents
Create Date: 2026-11-23 02:45:00.000000

A consumer has one queue (`consumer_<uuid hex>`) for every object type it asks for,
scoped to offerings. A delivery points at either a subscription queue or a consumer;
both foreign keys are SET NULL so the relay gives up a copy whose target went away.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_consumers"
down_revision: str | None = "0004_agents"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "event_consumers",
        sa.Column("uuid", sa.Uuid(), nullable=False),
        sa.Column("user_uuid", sa.Uuid(), nullable=False),
        sa.Column("agent_identity_uuid", sa.Uuid(), nullable=True),
        sa.Column("object_types", sa.JSON(), nullable=False),
        sa.Column("queue_name", sa.String(length=255), nullable=False),
        sa.Column("vhost", sa.String(length=64), nullable=False),
        sa.Column("broker_password_hash", sa.String(length=128), nullable=True),
        sa.Column("broker_state", sa.String(length=16), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_identity_uuid"],
            ["agent_identities.uuid"],
            name=op.f("fk_event_consumers_agent_identity_uuid_agent_identities"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["user_uuid"],
            ["users.uuid"],
            name=op.f("fk_event_consumers_user_uuid_users"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("uuid", name=op.f("pk_event_consumers")),
        sa.UniqueConstraint(
            "agent_identity_uuid", name=op.f("uq_event_consumers_agent_identity_uuid")
        ),
        sa.UniqueConstraint("queue_name", name=op.f("uq_event_consumers_queue_name")),
    )
    op.create_index(
        op.f("ix_event_consumers_user_uuid"), "event_consumers", ["user_uuid"], unique=False
    )
    op.create_index(op.f("ix_event_consumers_vhost"), "event_consumers", ["vhost"], unique=False)
    op.create_table(
        "event_consumer_scopes",
        sa.Column("consumer_uuid", sa.Uuid(), nullable=False),
        sa.Column("offering_uuid", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["consumer_uuid"],
            ["event_consumers.uuid"],
            name=op.f("fk_event_consumer_scopes_consumer_uuid_event_consumers"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["offering_uuid"],
            ["offerings.uuid"],
            name=op.f("fk_event_consumer_scopes_offering_uuid_offerings"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "consumer_uuid", "offering_uuid", name=op.f("pk_event_consumer_scopes")
        ),
    )
    op.create_index(
        op.f("ix_event_consumer_scopes_offering_uuid"),
        "event_consumer_scopes",
        ["offering_uuid"],
        unique=False,
    )
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("consumer_uuid", sa.Uuid(), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_deliveries_consumer_uuid"), ["consumer_uuid"], unique=False
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_deliveries_consumer_uuid_event_consumers"),
            "event_consumers",
            ["consumer_uuid"],
            ["uuid"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_deliveries_consumer_uuid_event_consumers"), type_="foreignkey"
        )
        batch_op.drop_index(batch_op.f("ix_deliveries_consumer_uuid"))
        batch_op.drop_column("consumer_uuid")
    op.drop_index(
        op.f("ix_event_consumer_scopes_offering_uuid"), table_name="event_consumer_scopes"
    )
    op.drop_table("event_consumer_scopes")
    op.drop_index(op.f("ix_event_consumers_vhost"), table_name="event_consumers")
    op.drop_index(op.f("ix_event_consumers_user_uuid"), table_name="event_consumers")
    op.drop_table("event_consumers")
