"""installation identity: one row naming this database's installation

Revision ID: 0009_installation
Revises: 0007_agents108
Create Date: 2026-11-26 09:00:00.000000

Every vhost and broker user queuekeeper creates carries `queuekeeper-installation:<uuid>`
next to `queuekeeper:<instance name>`, so two installations sharing a broker, or a
database restored from an older backup, never take each other's objects for their own
(docs/decisions/001-installation-identity.md). The identity is made here, once; a
database migrated before this revision gets it here too, and the service adopts the
objects it has rows for (docs/howto/upgrade.md, "Upgrading to installation identities").
"""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0009_installation"
down_revision: str | None = "0007_agents108"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A database rolled back past this revision kept its row (see downgrade): reuse it.
    if sa.inspect(op.get_bind()).has_table("installation"):
        return
    table = op.create_table(
        "installation",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("uuid", sa.Uuid(), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
        sa.UniqueConstraint("uuid", name=op.f("uq_installation_uuid")),
    )
    op.bulk_insert(table, [{"id": 1, "uuid": uuid.uuid4(), "created": datetime.now(UTC)}])


def downgrade() -> None:
    # The table stays: every broker object carries this uuid, and a new one made by the next
    # upgrade would turn them all into another installation's (decision 001). Older
    # releases ignore the table.
    pass
