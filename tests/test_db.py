"""`db.DriverRead`: the same row as SQLAlchemy gives, on either database, and a database
failure raised as SQLAlchemy's so the error handlers answer it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from sqlalchemy import bindparam, func, literal, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.errors import DatabaseProblem, classify_database_error
from queuekeeper.models import User

BY_DIGEST = db.DriverRead(
    select(*db.columns_of(User), literal("fixed").label("constant")).where(
        User.token_hash == bindparam("digest")
    )
)


@pytest.fixture
async def engine(settings: Settings, clean_state: None) -> AsyncIterator[AsyncEngine]:
    engine = db.create_engine(settings)
    yield engine
    await engine.dispose()


async def _user(engine: AsyncEngine, **columns: object) -> uuid.UUID:
    user_uuid = uuid.uuid4()
    async with db.create_sessionmaker(engine)() as session:
        session.add(User(uuid=user_uuid, username="u", **columns))
        await session.commit()
    return user_uuid


async def test_a_row_reads_as_through_sqlalchemy(engine: AsyncEngine) -> None:
    expires = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    user_uuid = await _user(engine, token_hash="d" * 64, token_expires_at=expires, is_active=False)
    row = await BY_DIGEST.first(engine, {"digest": "d" * 64})
    async with engine.connect() as connection:
        expected = (
            (await connection.execute(BY_DIGEST.statement, {"digest": "d" * 64})).mappings().one()
        )
    assert row == dict(expected)
    assert row is not None
    # The types' own processors ran: an aware datetime, a uuid, a bool, a NULL, a literal.
    assert (row["uuid"], row["token_expires_at"], row["is_active"]) == (user_uuid, expires, False)
    assert row["token_expires_at"].tzinfo is not None
    assert row["broker_password_hash"] is None
    assert row["constant"] == "fixed"
    user = db.detached(User, {key: row[key] for key in row if key != "constant"})
    async with db.create_sessionmaker(engine)() as session:
        merged = await session.merge(user, load=False)
        assert merged.username == "u"
        assert not session.dirty


async def test_no_row_is_none(engine: AsyncEngine) -> None:
    assert await BY_DIGEST.first(engine, {"digest": "nobody"}) is None


async def test_a_lost_connection_is_a_dbapi_error_and_the_pool_recovers(
    engine: AsyncEngine, settings: Settings
) -> None:
    if settings.is_sqlite:
        pytest.skip("an SQLite connection cannot be terminated from outside")
    await _user(engine, token_hash="e" * 64)
    pids = db.DriverRead(select(func.pg_backend_pid().label("pid")))
    first = await pids.first(engine, {})
    assert first is not None
    # From outside the pool, whose one connection is the one terminated.
    admin = await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))
    try:
        await admin.execute("SELECT pg_terminate_backend($1)", first["pid"])
    finally:
        await admin.close()
    with pytest.raises(DBAPIError) as raised:
        await BY_DIGEST.first(engine, {"digest": "e" * 64})
    assert raised.value.connection_invalidated
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    # The dead connection left the pool: the next read gets a live one.
    assert await BY_DIGEST.first(engine, {"digest": "e" * 64}) is not None
