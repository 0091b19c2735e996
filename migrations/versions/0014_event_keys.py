"""events: project_uuid and subject_user_uuid, offering_uuid optional; global consumers' index

Revision ID: 0014_event_keys
Revises: 0013_bindings
Create Date: 2026-11-28 13:30:00.000000

Contract §12: an event's scope keys are its offering's chain, its own project and the user
it is about (an identity event may have no offering); the recipients statement reads the
global consumers through a partial index, so many bound consumers cost nothing.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_event_keys"
down_revision: str | None = "0013_bindings"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.alter_column("offering_uuid", existing_type=sa.Uuid(), nullable=True)
        batch.add_column(sa.Column("project_uuid", sa.Uuid(), nullable=True))
        batch.add_column(sa.Column("subject_user_uuid", sa.Uuid(), nullable=True))
    op.create_index(
        "ix_event_consumers_global",
        "event_consumers",
        ["uuid"],
        postgresql_where=sa.text("is_global"),
    )


def downgrade() -> None:
    op.drop_index("ix_event_consumers_global", table_name="event_consumers")
    op.execute("DELETE FROM events WHERE offering_uuid IS NULL")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("subject_user_uuid")
        batch.drop_column("project_uuid")
        batch.alter_column("offering_uuid", existing_type=sa.Uuid(), nullable=False)
