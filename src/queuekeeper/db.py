"""Engine and sessions, on PostgreSQL (asyncpg), the only database: production's, or the
embedded server of `make run` (embedded.py).

Every statement goes through SQLAlchemy: ORM sessions for requests, Core connections where
a job streams or a read needs no transaction (`read_one`). The one exception is the
outbox's hot statements, plain SQL on asyncpg in events/outbox_postgres.py
(docs/decisions/008-driver-path.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from sqlalchemy import Select, inspect
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import make_transient_to_detached
from sqlalchemy.sql.elements import Label

from queuekeeper.config import Settings


def create_engine(settings: Settings, *, pool_size: int | None = None) -> AsyncEngine:
    """No pre-ping by default: on asyncpg it costs three round trips per checkout (measured:
    single-event accept p50 36 -> 11 ms at 200 events/s). A connection that died with the
    server fails its first statement instead; SQLAlchemy then invalidates the pool and the
    request answers 503 (errors.py), so one request per dead connection pays, not all."""
    size = pool_size or settings.database_pool_size
    return create_async_engine(
        settings.database_url,
        pool_size=size,
        max_overflow=size,
        pool_recycle=1800,  # never keep a connection past typical firewall idle timeouts
        connect_args={"timeout": settings.database_connect_timeout},
        # Bound values (token digests, broker password hashes) stay out of SQL logs and
        # out of the text of database exceptions.
        hide_parameters=True,
    )


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


# What runs a Core statement: an ORM session, or a plain connection where a unit of work
# needs no ORM (create_queue's insert: a session cost it 0.3 ms more CPU).
Executor = AsyncSession | AsyncConnection


M = TypeVar("M")


async def read_one(
    engine: AsyncEngine, statement: Select[Any], parameters: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The first row of a read that needs no transaction (the token lookup on every agent
    call; create_queue's context), on a pooled connection in autocommit: no BEGIN and no
    ROLLBACK round trips around the one statement."""
    async with engine.connect() as connection:
        await connection.execution_options(isolation_level="AUTOCOMMIT")
        row = (await connection.execute(statement, parameters)).mappings().first()
    return dict(row) if row is not None else None


def detached(model: type[M], row: Mapping[str, Any]) -> M:
    """An ORM object from a row of its columns, as if loaded and its session closed: a
    session takes it with `merge(..., load=False)`, without a query."""
    instance = model(**row)
    make_transient_to_detached(instance)
    return instance


def columns_of(model: type[Any]) -> list[Label[Any]]:
    """Every mapped column of `model`, labelled with its attribute's name (for `detached`)."""
    return [attribute.expression.label(attribute.key) for attribute in inspect(model).column_attrs]
