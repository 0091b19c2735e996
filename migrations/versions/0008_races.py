"""event_consumers.scope_key: a repeat of /api/event-consumers/register/ finds the same row

Revision ID: 0008_races
Revises: 0009_installation
Create Date: 2026-11-26 09:00:00.000000

The sha256 of the sorted offering uuids (hex) a consumer was registered for through
/api/event-consumers/register/, unique per owner: identical registrations in parallel
can no longer make one consumer each (docs/decisions/002-owner-lock.md). Filled in for the
existing consumers of that route; of consumers already made twice for the same set (by
that race), the oldest keeps the key and the others keep none (they stay as they are,
and a registration finds the oldest).
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_races"
down_revision: str | None = "0009_installation"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_consumers = sa.table(
    "event_consumers",
    sa.column("uuid", sa.Uuid()),
    sa.column("user_uuid", sa.Uuid()),
    sa.column("agent_identity_uuid", sa.Uuid()),
    sa.column("created", sa.DateTime(timezone=True)),
    sa.column("scope_key", sa.String(64)),
)
_scopes = sa.table(
    "event_consumer_scopes",
    sa.column("consumer_uuid", sa.Uuid()),
    sa.column("offering_uuid", sa.Uuid()),
)


def upgrade() -> None:
    with op.batch_alter_table("event_consumers") as batch:
        batch.add_column(sa.Column("scope_key", sa.String(length=64), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(_consumers.c.uuid, _consumers.c.user_uuid)
        .where(_consumers.c.agent_identity_uuid.is_(None))
        .order_by(_consumers.c.created, _consumers.c.uuid)
    ).all()
    offerings: dict[object, list[str]] = {}
    for consumer, offering in bind.execute(
        sa.select(_scopes.c.consumer_uuid, _scopes.c.offering_uuid)
    ):
        offerings.setdefault(consumer, []).append(offering.hex)
    taken: set[tuple[object, str]] = set()
    for consumer, owner in rows:
        joined = ",".join(sorted(offerings.get(consumer, [])))
        key = hashlib.sha256(joined.encode("ascii")).hexdigest()
        if (owner, key) in taken:
            continue
        taken.add((owner, key))
        bind.execute(_consumers.update().where(_consumers.c.uuid == consumer).values(scope_key=key))
    with op.batch_alter_table("event_consumers") as batch:
        batch.create_index(
            "uq_event_consumers_user_scope_key", ["user_uuid", "scope_key"], unique=True
        )


def downgrade() -> None:
    with op.batch_alter_table("event_consumers") as batch:
        batch.drop_index("uq_event_consumers_user_scope_key")
        batch.drop_column("scope_key")
