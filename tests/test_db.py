"""`db.read_one`, and the outbox's statements on the driver (`events/outbox_postgres.py`):
the same rows as SQLAlchemy gives and takes, and a database failure raised as SQLAlchemy's
so the error handlers (and the intake's retry on a constraint) answer it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import bindparam, func, literal, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.errors import DatabaseProblem, classify_database_error
from queuekeeper.events.outbox import PARKED_REASON, Outbox
from queuekeeper.events.outbox_postgres import EVENT_COLUMNS, KeptConnection
from queuekeeper.events.repository import DELIVERIES, EVENTS
from queuekeeper.models import User
from tests.helpers import database_statements
from tests.pg_refusing import at_port, refusing_postgres
from tests.proxy import tcp_proxy

BY_DIGEST = select(*db.columns_of(User), literal("fixed").label("constant")).where(
    User.token_hash == bindparam("digest")
)
PID = select(func.pg_backend_pid().label("pid"))


async def _read(engine: AsyncEngine, digest: str) -> dict[str, object] | None:
    return await db.read_one(engine, BY_DIGEST, {"digest": digest})


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
    row = await _read(engine, "d" * 64)
    # Every column as written, by value.
    assert row == {
        "uuid": user_uuid,
        "username": "u",
        "full_name": "Ada",
        "email": "ada@example.org",
        "token_hash": "d" * 64,
        "broker_password_hash": None,
        "token_expires_at": expires,
        "is_active": False,
        "is_staff": False,
        "is_support": False,
        "created": created,
        "modified": created,
        "constant": "fixed",
    }
    async with engine.connect() as connection:
        expected = (await connection.execute(BY_DIGEST, {"digest": "d" * 64})).mappings().one()
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
    assert await _read(engine, "nobody") is None


async def test_a_lost_connection_is_a_dbapi_error_and_the_pool_recovers(
    engine: AsyncEngine, settings: Settings
) -> None:
    await _user(engine, token_hash="e" * 64)
    first = await db.read_one(engine, PID, {})
    assert first is not None
    # From outside the pool, whose one connection is the one terminated.
    await _terminate(settings, [first["pid"]])
    with pytest.raises(DBAPIError) as raised:
        await _read(engine, "e" * 64)
    assert raised.value.connection_invalidated
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    # The dead connection left the pool: the next read gets a live one.
    assert await _read(engine, "e" * 64) is not None


@pytest.mark.parametrize(
    ("sqlstate", "message"),
    [("57P03", "the database system is starting up"), ("53300", "too many clients already")],
)
async def test_a_refused_connection_is_a_dbapi_error_read_as_unreachable(
    settings: Settings, sqlstate: str, message: str
) -> None:
    """What PostgreSQL answers while it restarts or is full: a 503, never a 500."""
    async with refusing_postgres(sqlstate, message) as port:
        url = at_port(settings.database_url, port)
        engine = db.create_engine(settings.model_copy(update={"database_url": url}))
        try:
            with pytest.raises(DBAPIError) as raised:
                await _read(engine, "x")
        finally:
            await engine.dispose()
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE


async def test_a_database_that_accepts_and_never_answers_is_unreachable_after_the_timeout(
    settings: Settings,
) -> None:
    """A server that takes the connection and says nothing (a hung host, a stalled proxy):
    the read gives up after `database_connect_timeout`, read as unreachable (a 503), rather
    than waiting as long as the driver's own minute."""
    with tcp_proxy(blackhole=True) as hang:
        url = at_port(settings.database_url, hang.port)
        engine = db.create_engine(
            settings.model_copy(update={"database_url": url, "database_connect_timeout": 0.5})
        )
        started = time.monotonic()
        try:
            # asyncpg's TimeoutError, an OSError: the error handlers answer it 503.
            with pytest.raises(TimeoutError) as raised:
                await _read(engine, "x")
        finally:
            await engine.dispose()
        waited = time.monotonic() - started
    assert hang.accepted == 1
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    assert 0.4 < waited < 4, waited


async def test_every_connection_as_old_as_a_dead_one_is_replaced(
    engine: AsyncEngine, settings: Settings
) -> None:
    """After a server restart every pooled connection is dead: one read fails, not one per
    pooled connection (as SQLAlchemy's own statements do)."""
    await _user(engine, token_hash="f" * 64)
    pids = select(func.pg_backend_pid().label("pid"), func.pg_sleep(0.2).label("slept"))
    rows = await asyncio.gather(*(db.read_one(engine, pids, {}) for _ in range(3)))
    await _terminate(settings, [row["pid"] for row in rows if row is not None])
    outcomes = []
    for _ in range(3):
        try:
            await _read(engine, "f" * 64)
            outcomes.append("ok")
        except DBAPIError:
            outcomes.append("failed")
    assert outcomes == ["failed", "ok", "ok"]


async def test_reads_past_the_pool_size_leave_no_connection_behind(settings: Settings) -> None:
    """A connection beyond the pool's size (an overflow) is closed when it is returned, not
    left open on the server."""
    engine = db.create_engine(settings, pool_size=1)
    reads = select(func.pg_backend_pid().label("pid"), func.pg_sleep(0.05).label("slept"))
    pids: set[int] = set()
    try:
        for _ in range(5):
            rows = await asyncio.gather(*(db.read_one(engine, reads, {}) for _ in range(2)))
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


def _outbox(engine: AsyncEngine, settings: Settings) -> Outbox:
    return Outbox(engine, settings)


PAYLOAD = {"order": {"uuid": "x", "items": [1, "two", None]}}


def _event(event_id: str, user_uuids: list[str] | None = None) -> dict[str, object]:
    return {
        "event_id": event_id,
        "offering_uuid": uuid.uuid4(),
        # a JSON list column beside user_uuids: one item per row, whether a list or null
        "offering_uuids": [uuid.uuid4().hex, uuid.uuid4().hex] if user_uuids else None,
        "object_type": "order",
        "payload": json.dumps(PAYLOAD),  # the store gives the payload as its JSON text
        "user_uuids": user_uuids,
        "queued": 2,
        "skipped_unregistered": 0,
        "accepted": datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        "project_uuid": None,
        "subject_user_uuid": uuid.uuid4() if user_uuids else None,
    }


def _copy_of(event_id: str) -> dict[str, object]:
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    return {
        "event_id": event_id,
        "queue_uuid": None,
        "consumer_uuid": None,
        "queue_name": "q",
        "vhost": "v",
        "offering_uuid": None,
        "state": "pending",
        "attempts": 0,
        "claimed_by": None,
        "claimed_until": None,
        "next_attempt_at": now,
        "created": now,
    }


async def _stored(engine: AsyncEngine) -> dict[str, dict[str, object]]:
    async with engine.connect() as connection:
        rows = (await connection.execute(select(*(EVENTS.c[c] for c in EVENT_COLUMNS)))).mappings()
        return {row["event_id"]: dict(row) for row in rows}


async def test_rows_inserted_in_one_statement_read_as_through_sqlalchemy(
    engine: AsyncEngine, settings: Settings
) -> None:
    outbox = _outbox(engine, settings)
    rows = [_event("a", ["u1", "u2"]), _event("b"), _event("c", [])]
    with database_statements(engine) as statements:
        async with outbox.store_unit() as unit:
            returned, _ = await unit.insert(rows, [])
    assert len(statements) == 1  # three rows, one statement
    # Read back through SQLAlchemy: what the driver wrote is what SQLAlchemy reads.
    stored = await _stored(engine)
    assert stored == {row["event_id"]: {**row, "payload": PAYLOAD} for row in rows}
    # A JSON value that is itself a list stays one value (not an array dimension).
    assert stored["a"]["user_uuids"] == ["u1", "u2"]
    assert stored["b"]["user_uuids"] is None
    assert returned == {"a", "b", "c"}
    # ON CONFLICT DO NOTHING: only the new row comes back, and only its copies are written
    # (an event stored before keeps its first copies).
    async with outbox.store_unit() as unit:
        again, copies = await unit.insert(
            [_event("a"), _event("d")], [_copy_of("a"), _copy_of("d"), _copy_of("d")]
        )
    assert again == {"d"}
    assert [(event_id, queue) for _id, event_id, queue, _consumer in copies] == [
        ("d", None),
        ("d", None),
    ]
    first, second = (copy[0] for copy in copies)
    assert first < second  # written in the order given: acceptance order


async def test_a_constraint_violation_is_an_integrity_error_and_rolls_back(
    engine: AsyncEngine, settings: Settings
) -> None:
    """What the intake retries on (a recipient deleted under it): a
    copy for a queue that is not there. The store writes all or nothing: the new event
    beside it is not stored either."""
    outbox = _outbox(engine, settings)
    async with outbox.store_unit() as unit:
        await unit.insert([_event("taken")], [])

    async def conflicting() -> None:
        async with outbox.store_unit() as unit:
            gone = {**_copy_of("new"), "queue_uuid": uuid.uuid4()}
            await unit.insert([_event("new")], [_copy_of("new"), gone])

    with pytest.raises(IntegrityError):
        await conflicting()
    assert set(await _stored(engine)) == {"taken"}
    copies = select(func.count()).select_from(DELIVERIES)
    async with engine.connect() as connection:
        assert (await connection.execute(copies)).scalar() == 0
    async with outbox.store_unit() as unit:  # the connection went back usable
        await unit.insert([_event("later")], [])
    assert set(await _stored(engine)) == {"taken", "later"}


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


async def test_an_unparked_copy_is_claimed_as_a_claim_takes_it(
    engine: AsyncEngine, settings: Settings
) -> None:
    """Parking's writes through the outbox: a copy parked by the relay
    holding it and released to another comes back as that relay's claim would have taken
    it (same row mapping, same lease rule), and only once."""
    outbox = _outbox(engine, settings)
    async with outbox.store_unit() as unit:
        await unit.insert([_event("e1"), _event("e2")], [_copy_of("e1"), _copy_of("e2")])
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)  # the copies' `next_attempt_at`
    claimed, _ = await outbox.claim("relay-a", now, 10)
    assert [item.event_id for item in claimed] == ["e1", "e2"]
    ids = [item.id for item in claimed]
    await outbox.park("relay-b", ids, now)  # not relay-b's to park: nothing moves
    assert await outbox.unpark("relay-b", "v", "q", 10, now) == (
        [],
        0,
        outbox.lease("relay-b", now),
    )
    await outbox.park("relay-a", ids, now)

    later = now + timedelta(seconds=1)
    released, _, lease = await outbox.unpark("relay-b", "v", "q", 1, later)  # the oldest only
    assert lease == outbox.lease("relay-b", later)
    assert released == [
        replace(claimed[0], created=later, judged_at=later, last_error=PARKED_REASON)
    ]
    rest, _, _ = await outbox.unpark("relay-b", "v", "q", 10, later)
    assert [item.id for item in rest] == [ids[1]]
    assert (await outbox.unpark("relay-b", "v", "q", 10, later))[0] == []
    async with engine.connect() as connection:
        rows = await connection.execute(
            select(DELIVERIES.c.state, DELIVERIES.c.claimed_by, DELIVERIES.c.claimed_until)
        )
        held = {(state, by, _utc(until)) for state, by, until in rows}
    assert held == {("pending", "relay-b", lease.until)}
    # Renewed and settled as any claimed copy.
    renewed, _ = await outbox.renew("relay-b", ids, later)
    assert renewed == set(ids)


async def _pid(unit: object) -> int:
    """The server process of a transaction on the driver."""
    driver = unit.driver  # type: ignore[attr-defined]
    (row,) = await driver.fetch("SELECT pg_backend_pid()")
    return int(row[0])


async def test_a_connection_lost_between_statements_is_a_dbapi_error_and_the_pool_recovers(
    engine: AsyncEngine, settings: Settings
) -> None:
    outbox = _outbox(engine, settings)

    async def cut_off() -> None:
        async with outbox.store_unit() as unit:
            await unit.insert([_event("lost")], [])
            await _terminate(settings, [await _pid(unit)])
            await unit.insert([_event("after")], [])

    with pytest.raises(DBAPIError) as raised:
        await cut_off()
    assert raised.value.connection_invalidated
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    async with outbox.store_unit() as unit:
        await unit.insert([_event("recovered")], [])
    # Each store's write is one statement, committed as it ran: the first stays, the one
    # that met the lost connection wrote nothing.
    assert set(await _stored(engine)) == {"lost", "recovered"}


async def test_after_a_lost_outbox_connection_every_connection_as_old_is_replaced(
    engine: AsyncEngine, settings: Settings
) -> None:
    """A server restart kills every pooled connection: the outbox's statement that meets
    the first dead one fails, and the pool serves live ones from then on (as SQLAlchemy's
    own statements do), not one failure per pooled connection."""
    pids = select(func.pg_backend_pid().label("pid"), func.pg_sleep(0.2).label("slept"))
    rows = await asyncio.gather(*(db.read_one(engine, pids, {}) for _ in range(3)))
    await _terminate(settings, [row["pid"] for row in rows if row is not None])
    outbox = _outbox(engine, settings)
    outcomes = []
    for index in range(3):
        try:
            async with outbox.store_unit() as unit:
                await unit.insert([_event(f"e{index}")], [])
            outcomes.append("ok")
        except DBAPIError:
            outcomes.append("failed")
    assert outcomes == ["failed", "ok", "ok"]


async def test_the_intakes_kept_connection_serves_store_after_store_and_recovers(
    engine: AsyncEngine, settings: Settings
) -> None:
    """The intake's stores keep one connection between them (no checkout each); one
    killed while kept fails the store that meets it, as a dead pooled connection did, the
    next store runs on a live one, and the connection goes back to the pool when unused."""
    outbox = _outbox(engine, settings)
    kept = KeptConnection(engine, idle_seconds=0.5)
    pids = []
    for name in ("k1", "k2", "k3"):
        async with outbox.store_unit(kept) as unit:
            await unit.insert([_event(name)], [])
            pids.append(await _pid(unit))
    assert len(set(pids)) == 1  # one connection for every store
    checked_out_now = engine.pool.checkedout()  # type: ignore[attr-defined]
    assert checked_out_now == 1  # held between stores, not returned

    await _terminate(settings, pids[:1])
    with pytest.raises(DBAPIError) as raised:
        async with outbox.store_unit(kept) as unit:
            await unit.insert([_event("lost")], [])
    assert classify_database_error(raised.value) is DatabaseProblem.UNREACHABLE
    async with outbox.store_unit(kept) as unit:
        await unit.insert([_event("k4")], [])
        assert await _pid(unit) != pids[0]
    assert set(await _stored(engine)) == {"k1", "k2", "k3", "k4"}

    await asyncio.sleep(0.6)  # unused past idle_seconds: the next store checks out afresh
    async with outbox.store_unit(kept) as unit:
        await unit.insert([_event("k5")], [])
    await kept.release()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["in a statement", "between statements"])
async def test_a_cancelled_transaction_leaves_nothing_and_no_connection_in_it(
    engine: AsyncEngine, settings: Settings, where: str
) -> None:
    """A request cancelled (its client gone, the process stopping) inside a transaction: the
    rows are not committed and no pooled connection stays inside the transaction."""
    started = asyncio.Event()
    outbox = _outbox(engine, settings)

    async def cancelled() -> None:
        async with outbox.store_unit() as unit:
            started.set()
            if where == "in a statement":
                await unit.driver.fetch("SELECT pg_sleep(5)")  # type: ignore[attr-defined]
            else:
                await asyncio.sleep(5)

    task = asyncio.create_task(cancelled())
    await started.wait()
    await asyncio.sleep(0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await _stored(engine) == {}
    async with outbox.store_unit() as unit:  # the pool serves one that works
        await unit.insert([_event("next")], [])
    assert set(await _stored(engine)) == {"next"}
    admin = await _admin(settings)
    try:
        stuck = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%'"
        )
    finally:
        await admin.close()
    assert stuck == []


async def _admin(settings: Settings) -> asyncpg.Connection:
    return await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))


async def _terminate(settings: Settings, pids: list[int]) -> None:
    """Terminate these server processes and wait until they are gone (the signal is
    asynchronous: on a loaded machine a statement could still reach one)."""
    admin = await _admin(settings)
    try:
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    for _ in range(100):
        if not await _alive(settings, set(pids)):
            return
        await asyncio.sleep(0.05)


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
