"""event consumers: bindings of customers, projects and users; global; payload filters

Revision ID: 0013_bindings
Revises: 0012_directory
Create Date: 2026-11-28 13:00:00.000000

Contract §12: a consumer binds a list of entities, or none (global, staff and support only),
and may filter copies on the message's top-level fields.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_bindings"
down_revision: str | None = "0012_directory"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("event_consumers") as batch:
        batch.add_column(
            sa.Column("is_global", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("payload_filters", sa.JSON(), nullable=False, server_default=sa.text("'{}'"))
        )
    op.create_table(
        "event_consumer_bindings",
        sa.Column("consumer_uuid", sa.Uuid(), nullable=False),
        sa.Column("scope_type", sa.String(16), nullable=False),
        sa.Column("scope_uuid", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["consumer_uuid"],
            ["event_consumers.uuid"],
            name="fk_event_consumer_bindings_consumer_uuid_event_consumers",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "consumer_uuid", "scope_type", "scope_uuid", name="pk_event_consumer_bindings"
        ),
    )
    op.create_index(
        "ix_event_consumer_bindings_scope",
        "event_consumer_bindings",
        ["scope_type", "scope_uuid"],
    )


def downgrade() -> None:
    op.drop_table("event_consumer_bindings")
    with op.batch_alter_table("event_consumers") as batch:
        batch.drop_column("payload_filters")
        batch.drop_column("is_global")
