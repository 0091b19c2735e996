"""Engine and sessions. PostgreSQL (asyncpg) in production, SQLite as the embedded default."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Insert,
    Select,
    Table,
    any_,
    bindparam,
    event,
    func,
    inspect,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import make_transient_to_detached
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import UpdateBase
from sqlalchemy.sql.elements import Label
from sqlalchemy.sql.visitors import InternalTraversal

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


Processor = Callable[[Any], Any] | None
M = TypeVar("M")
T = TypeVar("T")


@dataclass(frozen=True)
class _DriverStatement:
    sql: str
    names: tuple[str, ...]  # the positional parameters' keys, in order
    binds: tuple[Processor, ...]
    # What a parameter the caller does not pass is bound to: the statement's own literals.
    literals: dict[str, Any]
    results: tuple[tuple[str, Processor], ...]  # each column's key and result processor

    @classmethod
    def of(cls, statement: Select[Any] | UpdateBase, dialect: Dialect) -> _DriverStatement:
        compiled = statement.compile(dialect=dialect)
        # What SQLAlchemy would add at each execution, which the driver would not: an
        # expanding list (use `one_of`), a Python-side default or onupdate value.
        deferred = [b.key for b in compiled.binds.values() if b.expanding or b.literal_execute]
        deferred += [c.key for c in (*compiled.insert_prefetch, *compiled.update_prefetch)]
        if deferred:
            raise TypeError(f"not for the driver, SQLAlchemy fills these in: {deferred}")
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
        for column in statement.exported_columns:
            if column.key is None:
                raise TypeError(f"label every column a driver statement returns: {column}")
            impl = column.type.dialect_impl(dialect)
            results.append((column.key, impl.result_processor(dialect, None)))
        return cls(compiled.string, names, binds, literals, tuple(results))

    def arguments(self, parameters: Mapping[str, Any]) -> list[Any]:
        # A copy only for a statement that carries literals (none of ours on the hot path).
        values = {**self.literals, **parameters} if self.literals else parameters
        return [
            process(values[name]) if process else values[name]
            for name, process in zip(self.names, self.binds, strict=True)
        ]

    def row(self, record: Sequence[Any]) -> dict[str, Any]:
        return {
            key: process(value) if process else value
            for (key, process), value in zip(self.results, record, strict=True)
        }


async def driver_fetch(
    driver: Any, sql: str, arguments: Sequence[Any], *, first: bool = False
) -> list[Any]:
    """The one place a statement reaches asyncpg itself (tests count statements here).
    With `first`, at most the first row is transferred."""
    if first:
        record = await driver.fetchrow(sql, *arguments)
        return [] if record is None else [record]
    return cast(list[Any], await driver.fetch(sql, *arguments))


def _database_error(sql: str, exc: Exception, lost: bool) -> DBAPIError:
    """The driver's error as SQLAlchemy would raise it, so the handlers and the callers'
    `except IntegrityError` treat both paths alike (SQLSTATE class 23: a constraint)."""
    kind = IntegrityError if str(getattr(exc, "sqlstate", "")).startswith("23") else DBAPIError
    return kind(sql, None, exc, hide_parameters=True, connection_invalidated=lost)


class _Driver:
    """asyncpg's connection under a Core connection of SQLAlchemy's pool: checked out and
    returned through it, not `raw_connection()` (that wraps a refused connect as DBAPIError
    and closes an overflow connection in the greenlet asyncpg's adapter needs; outside it
    the pool logs and leaks it)."""

    def __init__(self, connection: AsyncConnection, driver: Any) -> None:
        self.connection = connection
        self.driver = driver

    async def run(
        self, statement: _DriverStatement, parameters: Mapping[str, Any], *, first: bool = False
    ) -> list[Any]:
        arguments = statement.arguments(parameters)
        fetched = driver_fetch(self.driver, statement.sql, arguments, first=first)
        return await self.call(fetched, statement.sql)

    async def call(self, step: Awaitable[T], sql: str) -> T:
        try:
            return await step
        except Exception as exc:
            lost = self.driver.is_closed()
            if lost:
                # What SQLAlchemy does on a disconnect: every connection as old as this
                # one is replaced at its next checkout (a server restart killed them all).
                await self.connection.run_sync(_invalidate_pool, exc)
                await self.connection.invalidate(exc)
            raise _database_error(sql, exc, lost) from exc
        except BaseException:
            await self.connection.invalidate()  # cancelled mid-statement: its state is unknown
            raise


@asynccontextmanager
async def _driver(engine: AsyncEngine) -> AsyncIterator[_Driver]:
    async with engine.connect() as connection:
        pooled = await connection.get_raw_connection()
        driver = _Driver(connection, pooled.driver_connection)
        try:
            yield driver
        finally:
            # SQLAlchemy's reset on return rolls back only the transactions it began: one
            # left open on the driver (a failed BEGIN, a cancelled ROLLBACK) must not go back.
            raw = driver.driver
            if not connection.invalidated and not raw.is_closed() and raw.is_in_transaction():
                await connection.invalidate()


class DriverQuery:
    """A statement returning rows (a SELECT, or DML with RETURNING), written once in
    SQLAlchemy, that runs on PostgreSQL straight on asyncpg (compiled once, the column types'
    bind and result processors applied) and on SQLite through SQLAlchemy Core.

    `postgresql` is the same statement spelled with PostgreSQL's own constructs where the
    two dialects need different ones (`insert_if_absent`)."""

    def __init__(
        self,
        statement: Select[Any] | UpdateBase,
        *,
        postgresql: Select[Any] | UpdateBase | None = None,
    ) -> None:
        self.statement = statement
        self.postgresql = postgresql if postgresql is not None else statement
        self._compiled: _DriverStatement | None = None

    def compiled(self, dialect: Dialect) -> _DriverStatement:
        if self._compiled is None:
            self._compiled = _DriverStatement.of(self.postgresql, dialect)
        return self._compiled


class DriverRead(DriverQuery):
    """A single-row read outside any transaction, for the reads on every agent call (the
    token lookup; create_queue's context): through an ORM session one cost 0.42-0.45 ms of
    CPU here, through a Core connection 0.27-0.31 ms, and as a DriverRead 0.20 ms (`python
    -m bench._reads`). What is skipped is what SQLAlchemy adds per statement (its execution
    context, the result's cursor wrapping, the session's unit of work). The connection's
    life is SQLAlchemy's (`_Driver`), and a disconnect invalidates the pool as SQLAlchemy's
    own statements do. A failed statement is raised as `DBAPIError`, so the error handlers
    answer it as any other."""

    async def first(
        self, engine: AsyncEngine, parameters: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        if engine.dialect.name != "postgresql":
            async with engine.connect() as connection:
                row = (await connection.execute(self.statement, parameters)).mappings().first()
            return dict(row) if row is not None else None
        statement = self.compiled(engine.dialect)
        async with _driver(engine) as driver:
            records = await driver.run(statement, parameters, first=True)
        return statement.row(records[0]) if records else None


class one_of(ColumnElement[bool]):
    """`column` is one of the list bound as `name`: on PostgreSQL `column = ANY(:name)`, one
    array parameter, so the statement is compiled once for any length and can run on the
    driver; elsewhere `column IN (:name)`, the list expanded at each execution."""

    type = Boolean()
    _is_implicitly_boolean = True  # a comparison: never written `... = 1` in a WHERE
    _traverse_internals = [
        ("column", InternalTraversal.dp_clauseelement),
        ("name", InternalTraversal.dp_string),
    ]

    def __init__(self, column: ColumnElement[Any], name: str) -> None:
        self.column = column
        self.name = name


@compiles(one_of)
def _expanding_in(element: one_of, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.column.in_(bindparam(element.name, expanding=True)), **kw)


@compiles(one_of, "postgresql")
def _any_of_array(element: one_of, compiler: SQLCompiler, **kw: Any) -> str:
    array = bindparam(element.name, type_=ARRAY(element.column.type))
    return compiler.process(element.column == any_(array), **kw)


def insert_if_absent(
    table: Table, names: Sequence[str], rows: Select[Any], returning: ColumnElement[Any]
) -> DriverQuery:
    """`INSERT ... SELECT ... ON CONFLICT DO NOTHING RETURNING`: the rows `rows` selects into
    the columns `names`, each unless it conflicts, spelled with each dialect's own insert
    construct. SQLite needs a WHERE in `rows` to read ON CONFLICT as the insert's."""
    spelled = [
        dialect.insert(table).from_select(names, rows).on_conflict_do_nothing().returning(returning)
        for dialect in (sqlite, postgresql)
    ]
    return DriverQuery(spelled[0], postgresql=spelled[1])


class DriverInsert:
    """An INSERT of any number of rows in one statement, with optional RETURNING.

    On PostgreSQL it is `INSERT ... SELECT unnest(:column_1), unnest(:column_2), ...`: one
    array parameter per column, so one statement compiled once serves one row or thousands
    on the driver. On SQLite it is SQLAlchemy's executemany ("insertmanyvalues")."""

    def __init__(
        self,
        table: Table,
        columns: Sequence[str],
        *,
        returning: Sequence[ColumnElement[Any]] = (),
        if_absent: bool = False,
    ) -> None:
        self.columns = tuple(columns)
        defaulted = [
            c.name for c in table.columns if c.default is not None and c.name not in columns
        ]
        if defaulted:
            # SQLAlchemy fills them on SQLite; the driver would not: name them, on both.
            raise TypeError(f"name every column with a default: {', '.join(defaulted)}")
        # One dimension: a JSON column's value that is itself a list stays one item.
        arrays = {name: ARRAY(table.c[name].type, dimensions=1) for name in self.columns}
        rows = select(
            *(func.unnest(bindparam(name, type_=arrays[name])).label(name) for name in self.columns)
        )
        driver = postgresql.insert(table).from_select(self.columns, rows)
        core: Insert = table.insert()
        if if_absent:
            driver = driver.on_conflict_do_nothing()
            core = sqlite.insert(table).on_conflict_do_nothing()
        self.returns = bool(returning)
        self.query = DriverQuery(
            core.returning(*returning) if returning else core,
            postgresql=driver.returning(*returning) if returning else driver,
        )


class Transaction(Protocol):
    """One unit of work on either database: `transaction(engine)` opens it. Usable only
    inside its block."""

    async def all(self, query: DriverQuery, parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every row of `query`, each a dict keyed by column."""

    async def insert(
        self, insert: DriverInsert, rows: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """Insert `rows` (each with every column `insert` names); the RETURNING rows."""

    async def execute(self, query: DriverQuery, parameters: Mapping[str, Any]) -> None:
        """Run a statement that returns no rows (an UPDATE)."""


class _DriverTransaction:
    def __init__(self, driver: _Driver) -> None:
        self.driver = driver
        self.dialect: Dialect = driver.connection.dialect

    async def all(self, query: DriverQuery, parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
        statement = query.compiled(self.dialect)
        return [statement.row(record) for record in await self.driver.run(statement, parameters)]

    async def insert(
        self, insert: DriverInsert, rows: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        if not rows:
            return []
        columns = {name: [row[name] for row in rows] for name in insert.columns}
        return await self.all(insert.query, columns)

    async def execute(self, query: DriverQuery, parameters: Mapping[str, Any]) -> None:
        await self.driver.run(query.compiled(self.dialect), parameters)


class _CoreTransaction:
    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection

    async def all(self, query: DriverQuery, parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
        result = await self.connection.execute(query.statement, parameters)
        return [dict(row) for row in result.mappings()]

    async def insert(
        self, insert: DriverInsert, rows: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        if not rows:
            return []
        result = await self.connection.execute(insert.query.statement, list(rows))
        return [dict(row) for row in result.mappings()] if insert.returns else []

    async def execute(self, query: DriverQuery, parameters: Mapping[str, Any]) -> None:
        await self.connection.execute(query.statement, parameters)


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[Transaction]:
    """A transaction for statements written once in SQLAlchemy (`DriverQuery`,
    `DriverInsert`), committed when the block ends and rolled back if it raises.

    On PostgreSQL the statements and the transaction run on asyncpg itself: one single
    event's store cost 1.39 ms of CPU through SQLAlchemy Core and 0.88 ms on the driver,
    against 0.39 ms for asyncpg alone (`python -m bench._store`;
    docs/decisions/008-driver-path.md). On SQLite, SQLAlchemy Core."""
    if engine.dialect.name != "postgresql":
        async with engine.begin() as connection:
            yield _CoreTransaction(connection)
        return
    async with _driver(engine) as driver:
        raw = driver.driver.transaction()
        try:
            await driver.call(raw.start(), "BEGIN")
        except BaseException:
            # asyncpg keeps a failed BEGIN as the connection's transaction: its next would
            # be a SAVEPOINT. Never hand it out again.
            if not driver.connection.invalidated:
                await driver.connection.invalidate()
            raise
        try:
            yield _DriverTransaction(driver)
        except BaseException:
            if not driver.driver.is_closed():
                try:
                    await raw.rollback()
                except BaseException:  # failed or cancelled: never hand it out again
                    await driver.connection.invalidate()
            raise
        await driver.call(raw.commit(), "COMMIT")


@asynccontextmanager
async def autocommit(engine: AsyncEngine) -> AsyncIterator[Transaction]:
    """As `transaction`, but each statement commits on its own (no BEGIN, no COMMIT): for
    statements that stand alone, such as the relay's settlements."""
    if engine.dialect.name != "postgresql":
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            yield _CoreTransaction(connection)
        return
    async with _driver(engine) as driver:
        yield _DriverTransaction(driver)


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
