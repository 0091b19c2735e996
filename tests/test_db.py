"""`db.DriverRead` and `db.transaction`: the same rows as SQLAlchemy gives and takes, on
either database, and a database failure raised as SQLAlchemy's so the error handlers (and
the intake's retry on a constraint) answer it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from sqlalchemy import bindparam, func, literal, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.errors import DatabaseProblem, classify_database_error
from queuekeeper.events.repository import EVENT_COLUMNS, EVENTS
from queuekeeper.models import Base, User
from tests.helpers import database_statements
from tests.pg_refusing import at_port, refusing_postgres

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
    created = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    user_uuid = await _user(
        engine,
        token_hash="d" * 64,
        token_expires_at=expires,
        is_active=False,
        full_name="Ada",
        email="ada@example.org",
        created=created,
        modified=created,
    )
    row = await BY_DIGEST.first(engine, {"digest": "d" * 64})
    # Every column as written, by value: on SQLite a `DriverRead` runs through SQLAlchemy,
    # so only values not read back through SQLAlchemy can tell a wrong row there.
    assert row == {
        "uuid": user_uuid,
        "username": "u",
        "full_name": "Ada",
        "email": "ada@example.org",
        "token_hash": "d" * 64,
        "broker_password_hash": None,
        "token_expires_at": expires,
        "is_active": False,
        "created": created,
        "modified": created,
        "constant": "fixed",
    }
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
    await _terminate(settings, [first["pid"]])
    with pytest.raises(DBAPIError) as raised:
        await BY_DIGEST.first(engine, {"digest": "e" * 64})
    assert raised.value.connection_invalidated
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    # The dead connection left the pool: the next read gets a live one.
    assert await BY_DIGEST.first(engine, {"digest": "e" * 64}) is not None


@pytest.mark.parametrize(
    ("sqlstate", "message"),
    [("57P03", "the database system is starting up"), ("53300", "too many clients already")],
)
async def test_a_refused_connection_is_a_dbapi_error_read_as_unreachable(
    settings: Settings, sqlstate: str, message: str
) -> None:
    """What PostgreSQL answers while it restarts or is full: a 503, never a 500."""
    if settings.is_sqlite:
        pytest.skip("PostgreSQL's refusals")
    async with refusing_postgres(sqlstate, message) as port:
        url = at_port(settings.database_url, port)
        engine = db.create_engine(settings.model_copy(update={"database_url": url}))
        try:
            with pytest.raises(DBAPIError) as raised:
                await BY_DIGEST.first(engine, {"digest": "x"})
        finally:
            await engine.dispose()
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE


async def test_every_connection_as_old_as_a_dead_one_is_replaced(
    engine: AsyncEngine, settings: Settings
) -> None:
    """After a server restart every pooled connection is dead: one read fails, not one per
    pooled connection (as SQLAlchemy's own statements do)."""
    if settings.is_sqlite:
        pytest.skip("an SQLite connection cannot be terminated from outside")
    await _user(engine, token_hash="f" * 64)
    pids = db.DriverRead(
        select(func.pg_backend_pid().label("pid"), func.pg_sleep(0.2).label("slept"))
    )
    rows = await asyncio.gather(*(pids.first(engine, {}) for _ in range(3)))
    await _terminate(settings, [row["pid"] for row in rows if row is not None])
    outcomes = []
    for _ in range(3):
        try:
            await BY_DIGEST.first(engine, {"digest": "f" * 64})
            outcomes.append("ok")
        except DBAPIError:
            outcomes.append("failed")
    assert outcomes == ["failed", "ok", "ok"]


async def test_reads_past_the_pool_size_leave_no_connection_behind(settings: Settings) -> None:
    """A connection beyond the pool's size (an overflow) is closed when it is returned, not
    left open on the server."""
    if settings.is_sqlite:
        pytest.skip("PostgreSQL's backends")
    engine = db.create_engine(settings, pool_size=1)
    reads = db.DriverRead(
        select(func.pg_backend_pid().label("pid"), func.pg_sleep(0.05).label("slept"))
    )
    pids: set[int] = set()
    try:
        for _ in range(5):
            rows = await asyncio.gather(*(reads.first(engine, {}) for _ in range(2)))
            pids.update(row["pid"] for row in rows if row is not None)
    finally:
        await engine.dispose()
    assert len(pids) > 1  # the bursts did go past the pool's one connection
    alive = await _alive(settings, pids)
    for _ in range(40):  # a closed connection's server process takes a moment to exit
        if not alive:
            break
        await asyncio.sleep(0.05)
        alive = await _alive(settings, pids)
    assert alive == set()


NEW_EVENTS = db.DriverInsert(
    EVENTS,
    EVENT_COLUMNS,
    returning=[EVENTS.c.event_id, EVENTS.c.payload, EVENTS.c.user_uuids, EVENTS.c.accepted],
    if_absent=True,
)
EVENTS_STRICTLY = db.DriverInsert(EVENTS, EVENT_COLUMNS)


def _event(event_id: str, user_uuids: list[str] | None = None) -> dict[str, object]:
    return {
        "event_id": event_id,
        "offering_uuid": uuid.uuid4(),
        # a JSON list column beside user_uuids: one item per row, whether a list or null
        "offering_uuids": [uuid.uuid4().hex, uuid.uuid4().hex] if user_uuids else None,
        "object_type": "order",
        "payload": {"order": {"uuid": "x", "items": [1, "two", None]}},
        "user_uuids": user_uuids,
        "queued": 2,
        "skipped_unregistered": 0,
        "accepted": datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
    }


async def _stored(engine: AsyncEngine) -> dict[str, dict[str, object]]:
    async with engine.connect() as connection:
        rows = (await connection.execute(select(*(EVENTS.c[c] for c in EVENT_COLUMNS)))).mappings()
        return {row["event_id"]: dict(row) for row in rows}


async def test_rows_inserted_in_one_statement_read_as_through_sqlalchemy(
    engine: AsyncEngine,
) -> None:
    rows = [_event("a", ["u1", "u2"]), _event("b"), _event("c", [])]
    with database_statements(engine) as statements:
        async with db.transaction(engine) as unit:
            returned = await unit.insert(NEW_EVENTS, rows)
    assert len(statements) == 1  # three rows, one statement, on either database
    stored = await _stored(engine)
    assert stored == {row["event_id"]: row for row in rows}
    # A JSON value that is itself a list stays one value (not an array dimension).
    assert stored["a"]["user_uuids"] == ["u1", "u2"]
    assert stored["b"]["user_uuids"] is None
    by_id = {row["event_id"]: row for row in returned}
    assert by_id["a"] == {key: rows[0][key] for key in by_id["a"]}
    # ON CONFLICT DO NOTHING: only the new row comes back.
    async with db.transaction(engine) as unit:
        again = await unit.insert(NEW_EVENTS, [_event("a"), _event("d")])
        assert await unit.insert(NEW_EVENTS, []) == []
    assert [row["event_id"] for row in again] == ["d"]


async def test_a_block_that_raises_leaves_nothing(engine: AsyncEngine) -> None:
    async def failing() -> None:
        async with db.transaction(engine) as unit:
            await unit.insert(NEW_EVENTS, [_event("gone")])
            raise RuntimeError("the caller failed after its statement")

    with pytest.raises(RuntimeError):
        await failing()
    assert await _stored(engine) == {}


async def test_a_constraint_violation_is_an_integrity_error_and_rolls_back(
    engine: AsyncEngine,
) -> None:
    """What the intake retries on (a recipient deleted under it), on either database."""
    async with db.transaction(engine) as unit:
        await unit.insert(EVENTS_STRICTLY, [_event("taken")])

    async def conflicting() -> None:
        async with db.transaction(engine) as unit:
            await unit.insert(EVENTS_STRICTLY, [_event("new")])
            await unit.insert(EVENTS_STRICTLY, [_event("taken")])

    with pytest.raises(IntegrityError):
        await conflicting()
    assert set(await _stored(engine)) == {"taken"}
    async with db.transaction(engine) as unit:  # the connection went back usable
        await unit.insert(EVENTS_STRICTLY, [_event("later")])
    assert set(await _stored(engine)) == {"taken", "later"}


def test_an_insert_names_every_column_with_a_default() -> None:
    with pytest.raises(TypeError, match="queued, skipped_unregistered"):
        db.DriverInsert(EVENTS, ["event_id", "offering_uuid", "object_type", "payload"])


async def test_each_autocommit_statement_stands_alone(engine: AsyncEngine) -> None:
    async def failing() -> None:
        async with db.autocommit(engine) as statements:
            await statements.insert(NEW_EVENTS, [_event("kept")])
            raise RuntimeError("the caller failed after its statement")

    with pytest.raises(RuntimeError):
        await failing()
    assert set(await _stored(engine)) == {"kept"}


async def test_a_connection_lost_in_a_transaction_is_a_dbapi_error_and_the_pool_recovers(
    engine: AsyncEngine, settings: Settings
) -> None:
    if settings.is_sqlite:
        pytest.skip("an SQLite connection cannot be terminated from outside")
    pid = db.DriverQuery(select(func.pg_backend_pid().label("pid")))

    async def cut_off() -> None:
        async with db.transaction(engine) as unit:
            await unit.insert(NEW_EVENTS, [_event("lost")])
            (row,) = await unit.all(pid, {})
            await _terminate(settings, [row["pid"]])
            await unit.insert(NEW_EVENTS, [_event("after")])

    with pytest.raises(DBAPIError) as raised:
        await cut_off()
    assert raised.value.connection_invalidated
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    async with db.transaction(engine) as unit:
        await unit.insert(NEW_EVENTS, [_event("recovered")])
    assert set(await _stored(engine)) == {"recovered"}


@pytest.mark.parametrize("where", ["in a statement", "between statements"])
async def test_a_cancelled_transaction_leaves_nothing_and_no_connection_in_it(
    engine: AsyncEngine, settings: Settings, where: str
) -> None:
    """A request cancelled (its client gone, the process stopping) inside a transaction: the
    rows are not committed and no pooled connection stays inside the transaction."""
    started = asyncio.Event()

    async def cancelled() -> None:
        async with db.transaction(engine) as unit:
            await unit.insert(NEW_EVENTS, [_event("cancelled")])
            started.set()
            if where == "in a statement" and not settings.is_sqlite:
                await unit.all(db.DriverQuery(select(func.pg_sleep(5).label("slept"))), {})
            else:
                await asyncio.sleep(5)

    task = asyncio.create_task(cancelled())
    await started.wait()
    await asyncio.sleep(0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await _stored(engine) == {}
    async with db.transaction(engine) as unit:  # the pool serves a connection that works
        await unit.insert(NEW_EVENTS, [_event("next")])
    assert set(await _stored(engine)) == {"next"}
    if not settings.is_sqlite:
        admin = await _admin(settings)
        try:
            stuck = await admin.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%'"
            )
        finally:
            await admin.close()
        assert stuck == []


def test_a_statement_the_driver_would_run_differently_is_refused(engine: AsyncEngine) -> None:
    """An expanding IN, or a column SQLAlchemy fills in at execution (an onupdate), would be
    sent as written by the driver: refused when compiled, on either database's dialect."""
    users = Base.metadata.tables["users"]
    expanding = db.DriverQuery(
        select(users.c.uuid).where(users.c.uuid.in_(bindparam("ids", expanding=True)))
    )
    with pytest.raises(TypeError, match="ids"):
        expanding.compiled(postgresql.dialect())
    updated = db.DriverQuery(update(users).values(is_active=False).returning(users.c.uuid))
    with pytest.raises(TypeError, match="modified"):
        updated.compiled(postgresql.dialect())


async def _admin(settings: Settings) -> asyncpg.Connection:
    return await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))


async def _terminate(settings: Settings, pids: list[int]) -> None:
    admin = await _admin(settings)
    try:
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


async def _alive(settings: Settings, pids: set[int]) -> set[int]:
    """Which of these server processes still serve a client."""
    admin = await _admin(settings)
    try:
        rows = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE pid = any($1::int[])", list(pids)
        )
        return {row["pid"] for row in rows}
    finally:
        await admin.close()
