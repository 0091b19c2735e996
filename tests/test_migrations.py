"""The migrations build exactly the schema the models describe, and run down and up again."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection

from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.models import Base


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": False})
    return list(compare_metadata(context, Base.metadata))


async def test_migrated_database_matches_models(database_url: str) -> None:
    engine = create_engine(Settings(database_url=database_url))
    try:
        async with engine.connect() as connection:
            differences = await connection.run_sync(_diff)
    finally:
        await engine.dispose()
    assert differences == []
