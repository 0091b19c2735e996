"""Async Alembic environment; the database URL comes from queuekeeper's settings."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.embedded import with_database
from queuekeeper.models import Base

config = context.config
target_metadata = Base.metadata


def _settings() -> Settings:
    url = config.attributes.get("database_url")
    # `alembic` run by hand with no URL set: the embedded server, as `queuekeeper migrate`.
    return Settings(database_url=url) if url else with_database(Settings(), create=True)


def run_migrations_offline() -> None:
    context.configure(
        url=_settings().database_url,
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    engine = create_engine(_settings())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
