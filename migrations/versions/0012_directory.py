"""customers, projects, roles; offerings' customer and project; users' staff and support

Revision ID: 0012_directory
Revises: 0011_parking
Create Date: 2026-11-28 12:40:00.000000

Contract §12: the directory the backend pushes grows the entities consumers bind to and the
roles that authorize them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_directory"
down_revision: str | None = "0011_parking"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "customers",
        sa.Column("uuid", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("uuid", name="pk_customers"),
    )
    op.create_table(
        "projects",
        sa.Column("uuid", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("customer_uuid", sa.Uuid(), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["customer_uuid"],
            ["customers.uuid"],
            name="fk_projects_customer_uuid_customers",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("uuid", name="pk_projects"),
    )
    op.create_index("ix_projects_customer_uuid", "projects", ["customer_uuid"])
    op.create_table(
        "roles",
        sa.Column("uuid", sa.Uuid(), nullable=False),
        sa.Column("user_uuid", sa.Uuid(), nullable=False),
        sa.Column("role_name", sa.String(128), nullable=False),
        sa.Column("scope_type", sa.String(16), nullable=False),
        sa.Column("scope_uuid", sa.Uuid(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["user_uuid"], ["users.uuid"], name="fk_roles_user_uuid_users", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("uuid", name="pk_roles"),
    )
    op.create_index("ix_roles_user_uuid", "roles", ["user_uuid"])
    op.create_index("ix_roles_scope", "roles", ["scope_type", "scope_uuid"])
    with op.batch_alter_table("offerings") as batch:
        batch.add_column(sa.Column("customer_uuid", sa.Uuid(), nullable=True))
        batch.add_column(sa.Column("project_uuid", sa.Uuid(), nullable=True))
        batch.create_foreign_key(
            "fk_offerings_customer_uuid_customers",
            "customers",
            ["customer_uuid"],
            ["uuid"],
            ondelete="SET NULL",
        )
        batch.create_foreign_key(
            "fk_offerings_project_uuid_projects",
            "projects",
            ["project_uuid"],
            ["uuid"],
            ondelete="SET NULL",
        )
    op.create_index("ix_offerings_customer_uuid", "offerings", ["customer_uuid"])
    op.create_index("ix_offerings_project_uuid", "offerings", ["project_uuid"])
    with op.batch_alter_table("users") as batch:
        batch.add_column(
            sa.Column("is_staff", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("is_support", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.drop_column("is_support")
        batch.drop_column("is_staff")
    op.drop_index("ix_offerings_project_uuid", table_name="offerings")
    op.drop_index("ix_offerings_customer_uuid", table_name="offerings")
    with op.batch_alter_table("offerings") as batch:
        batch.drop_constraint("fk_offerings_project_uuid_projects", type_="foreignkey")
        batch.drop_constraint("fk_offerings_customer_uuid_customers", type_="foreignkey")
        batch.drop_column("project_uuid")
        batch.drop_column("customer_uuid")
    op.drop_table("roles")
    op.drop_table("projects")
    op.drop_table("customers")
