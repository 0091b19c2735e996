"""queue_presence: whether each registered queue has a consumer, and since when it has none

Revision ID: 0010_presence
Revises: 0008_races
Create Date: 2026-11-26 12:30:00.000000

Contract §11: presence is shared by every replica (the one that sees a consumer leave is
not always the one that holds the queue's copies), so it lives in the database.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_presence"
down_revision: str | None = "0008_races"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "queue_presence",
        sa.Column("vhost", sa.String(64), nullable=False),
        sa.Column("queue_name", sa.String(255), nullable=False),
        sa.Column("consumers", sa.Integer(), nullable=False),
        sa.Column("away_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("returned_from", sa.DateTime(timezone=True), nullable=True),
        sa.Column("changed", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checked", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("vhost", "queue_name", name=op.f("pk_queue_presence")),
    )


def downgrade() -> None:
    op.drop_table("queue_presence")
