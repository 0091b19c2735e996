"""job_runs.actions: what each run did (or, dry, would do), item by item

Revision ID: 0003_reconcile
Revises: 0002_publish
Create Date: 2026-11-22 00:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_reconcile"
down_revision: str | None = "0002_publish"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("actions", sa.JSON(), nullable=False, server_default=sa.text("'[]'"))
        )


def downgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_column("actions")
