"""agent identities: one name per caller, one subscription per (identity, object type)

Revision ID: 0004_agents
Revises: 0003_reconcile
Create Date: 2026-11-22 00:30:00.000000

Both are unique indexes. They make the site agent's start-up idempotent under concurrency: two
agents starting at once cannot create two identities with one name, nor two
subscriptions for one identity and object type (NULLs, i.e. subscriptions not
made through an identity, are never equal, so they are not constrained).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004_agents"
down_revision: str | None = "0003_reconcile"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "uq_agent_identities_created_by_name",
        "agent_identities",
        ["created_by", "name"],
        unique=True,
    )
    op.create_index(
        "uq_event_subscriptions_agent_identity_type",
        "event_subscriptions",
        ["agent_identity_uuid", "observable_object_type"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("uq_event_subscriptions_agent_identity_type", table_name="event_subscriptions")
    op.drop_index("uq_agent_identities_created_by_name", table_name="agent_identities")
