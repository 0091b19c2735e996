"""Engine and sessions. PostgreSQL (asyncpg) in production, SQLite as the embedded default."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select, Table, event, inspect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import make_transient_to_detached
from sqlalchemy.sql.dml import ReturningInsert
from sqlalchemy.sql.elements import Label

from queuekeeper.config import Settings


def create_engine(settings: Settings, *, pool_size: int | None = None) -> AsyncEngine:
    """No pre-ping by default: on asyncpg it costs three round trips per checkout (measured:
    single-event accept p50 36 -> 11 ms at 200 events/s). A connection that died with the
    server fails its first statement instead; SQLAlchemy then invalidates the pool and the
    request answers 503 (errors.py), so one request per dead connection pays, not all."""
    if settings.is_sqlite:
        # One writer at a time: wait for the lock rather than fail with "database is locked".
        engine = create_async_engine(
            settings.database_url, connect_args={"timeout": 30}, hide_parameters=True
        )

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")  # cascades are off by default in SQLite
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    size = pool_size or settings.database_pool_size
    return create_async_engine(
        settings.database_url,
        pool_size=size,
        max_overflow=size,
        pool_recycle=1800,  # never keep a connection past typical firewall idle timeouts
        connect_args={"timeout": 5},
        # Bound values (token digests, broker password hashes) stay out of SQL logs and
        # out of the text of database exceptions.
        hide_parameters=True,
    )


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


# What runs a Core statement: an ORM session, or a plain connection where a unit of work
# needs no ORM (create_queue's insert: a session cost it 0.3 ms more CPU).
Executor = AsyncSession | AsyncConnection


def is_postgres(executor: Executor) -> bool:
    bind = executor if isinstance(executor, AsyncConnection) else executor.get_bind()
    return bind.dialect.name == "postgresql"


@dataclass(frozen=True)
class InsertIfAbsent:
    """`INSERT ... ON CONFLICT DO NOTHING RETURNING <column>`, which each of our two dialects
    spells with its own insert construct. Built once: for a single row, building the
    statement cost more than running it."""

    postgresql: ReturningInsert[Any]
    sqlite: ReturningInsert[Any]

    @classmethod
    def of(cls, table: Table, returning: ColumnElement[Any]) -> InsertIfAbsent:
        return cls(
            postgresql.insert(table).on_conflict_do_nothing().returning(returning),
            sqlite.insert(table).on_conflict_do_nothing().returning(returning),
        )

    @classmethod
    def from_select(
        cls, table: Table, names: Sequence[str], rows: Select[Any], returning: ColumnElement[Any]
    ) -> InsertIfAbsent:
        """`INSERT ... SELECT ...`: the rows `rows` selects into the columns `names`, each
        unless it conflicts. SQLite needs a WHERE in `rows` to read the statement's ON
        CONFLICT as the insert's."""
        return cls(
            postgresql.insert(table)
            .from_select(names, rows)
            .on_conflict_do_nothing()
            .returning(returning),
            sqlite.insert(table)
            .from_select(names, rows)
            .on_conflict_do_nothing()
            .returning(returning),
        )

    def on(self, executor: Executor) -> ReturningInsert[Any]:
        return self.postgresql if is_postgres(executor) else self.sqlite


Processor = Callable[[Any], Any] | None
M = TypeVar("M")


@dataclass(frozen=True)
class _DriverStatement:
    sql: str
    names: tuple[str, ...]  # the positional parameters' keys, in order
    binds: tuple[Processor, ...]
    # What a parameter the caller does not pass is bound to: the statement's own literals.
    literals: dict[str, Any]
    results: tuple[tuple[str, Processor], ...]  # each column's key and result processor


class DriverRead:
    """A single-row SELECT that runs, on PostgreSQL, straight on asyncpg's connection from
    SQLAlchemy's pool; on SQLite through SQLAlchemy Core.

    For the reads on every agent call (the token lookup; create_queue's context): through an
    ORM session one cost 0.42-0.45 ms of CPU here, through a Core connection 0.27-0.31 ms,
    and as a DriverRead 0.20 ms (`python -m bench._reads`). The statement is still written
    once, in SQLAlchemy, and compiled once by its dialect; the column types' own bind and
    result processors are applied, so a row reads the same on both paths. What is skipped
    is what SQLAlchemy adds per statement (its execution context, the result's cursor
    wrapping, the session's unit of work). The connection's life is SQLAlchemy's: checked
    out and returned through a Core connection (a refused connect is its DBAPIError, an
    overflow connection is closed properly), and a disconnect invalidates the pool as
    SQLAlchemy's own statements do. A failed statement is raised as `DBAPIError`, so the
    error handlers answer it as any other."""

    def __init__(self, statement: Select[Any]) -> None:
        self.statement = statement
        self._compiled: _DriverStatement | None = None

    def _for(self, engine: AsyncEngine) -> _DriverStatement:
        if self._compiled is None:
            dialect = engine.dialect
            compiled = self.statement.compile(dialect=dialect)
            names = tuple(compiled.positiontup or ())
            binds = tuple(
                compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
                for name in names
            )
            literals = {
                name: compiled.binds[name].effective_value
                for name in names
                if not compiled.binds[name].required
            }
            results = []
            for column in self.statement.selected_columns:
                if column.key is None:
                    raise TypeError(f"label every column of a DriverRead: {column}")
                impl = column.type.dialect_impl(dialect)
                results.append((column.key, impl.result_processor(dialect, None)))
            self._compiled = _DriverStatement(
                compiled.string, names, binds, literals, tuple(results)
            )
        return self._compiled

    async def first(
        self, engine: AsyncEngine, parameters: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        if engine.dialect.name != "postgresql":
            async with engine.connect() as connection:
                row = (await connection.execute(self.statement, parameters)).mappings().first()
            return dict(row) if row is not None else None
        statement = self._for(engine)
        # A copy only for a statement that carries literals (none of ours on the hot path).
        values = {**statement.literals, **parameters} if statement.literals else parameters
        arguments = [
            process(values[name]) if process else values[name]
            for name, process in zip(statement.names, statement.binds, strict=True)
        ]
        # Checked out and returned through a Core connection, not `raw_connection()`: that
        # wraps a refused connect as DBAPIError and closes an overflow connection in the
        # greenlet asyncpg's adapter needs (outside it the pool logs and leaks it).
        async with engine.connect() as connection:
            pooled = await connection.get_raw_connection()
            driver: Any = pooled.driver_connection
            try:
                record = await driver.fetchrow(statement.sql, *arguments)
            except Exception as exc:
                lost = driver.is_closed()
                if lost:
                    # What SQLAlchemy does on a disconnect: every connection as old as this
                    # one is replaced at its next checkout (a server restart killed them all).
                    await connection.run_sync(_invalidate_pool, exc)
                    await connection.invalidate(exc)
                raise DBAPIError(
                    statement.sql, None, exc, hide_parameters=True, connection_invalidated=lost
                ) from exc
            except BaseException:
                await connection.invalidate()  # cancelled mid-statement: its state is unknown
                raise
        if record is None:
            return None
        return {
            key: process(value) if process else value
            for (key, process), value in zip(statement.results, record, strict=True)
        }


def _invalidate_pool(connection: Connection, exc: BaseException) -> None:
    pooled = connection.connection
    # SQLAlchemy's own disconnect handling calls it so (Connection._handle_dbapi_exception);
    # the pool has no public spelling of it.
    connection.engine.pool._invalidate(pooled, exc, _checkin=False)


def detached(model: type[M], row: Mapping[str, Any]) -> M:
    """An ORM object from a row of its columns, as if loaded and its session closed: a
    session takes it with `merge(..., load=False)`, without a query."""
    instance = model(**row)
    make_transient_to_detached(instance)
    return instance


def columns_of(model: type[Any]) -> list[Label[Any]]:
    """Every mapped column of `model`, labelled with its attribute's name (for `detached`)."""
    return [attribute.expression.label(attribute.key) for attribute in inspect(model).column_attrs]


async def listen(
    engine: AsyncEngine, channel: str, callback: Callable[[], None], until: asyncio.Event
) -> None:
    """Call `callback` on every PostgreSQL NOTIFY on `channel` until `until` is set, holding
    one connection of `engine`'s pool. Returns when the connection is lost (the caller
    listens again) or at `until`. asyncpg does the LISTEN; SQLAlchemy has no API for it."""
    lost = asyncio.Event()
    async with engine.connect() as connection:
        raw = await connection.get_raw_connection()
        driver: Any = raw.driver_connection

        def on_notify(*_args: object) -> None:
            callback()

        def on_lost(*_args: object) -> None:
            lost.set()

        await driver.add_listener(channel, on_notify)
        driver.add_termination_listener(on_lost)
        try:
            stop, gone = asyncio.ensure_future(until.wait()), asyncio.ensure_future(lost.wait())
            try:
                await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                gone.cancel()
        finally:
            driver.remove_termination_listener(on_lost)
            if not lost.is_set() and not driver.is_closed():
                await driver.remove_listener(channel, on_notify)
