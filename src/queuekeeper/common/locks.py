"""Advisory locks: one run of a job at a time, no deletion racing a registration, and one
writer at a time for a user's broker credentials and objects (`user_key`).

PostgreSQL's transaction-level advisory locks (`pg_*advisory_xact_lock*`), released by the
database when the transaction ends, so a crashed process never leaves one behind.

Keys are 64-bit digests of a name, scoped (as all advisory locks are) to the
database: two installations with their own databases never contend.

One family, one statement for any number of locks (`_take`): `guard_all` (and `guard`,
one lock) holds them for the transaction of a session or a connection;
`transaction_holding` opens that transaction on a connection of its own, for a unit of
work on no session; `job_lock` only tries, on a connection held for a job's whole run.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from sqlalchemy import BigInteger, Select, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from queuekeeper.db import Executor

# create_subscription holds this shared while a broker user exists without its
# row; deleting orphan broker users takes it exclusive.
BROKER_USERS_KEY = "broker-users"


def lock_key(name: str) -> int:
    digest = hashlib.sha256(f"queuekeeper:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def user_key(user_uuid: uuid.UUID) -> str:
    """The owner lock (docs/decisions/002-owner-lock.md): every writer of a user's broker
    users, vhost or consumer rows holds it exclusively across "read the current rows and
    token hash -> broker calls -> commit", so the last writer is the database's truth."""
    return f"user:{user_uuid.hex}"


def vhost_key(vhost: str) -> str:
    return f"vhost:{vhost}"


def job_key(job: str) -> str:
    return f"job:{job}"


_LOCK_FUNCTION = {True: func.pg_advisory_xact_lock, False: func.pg_advisory_xact_lock_shared}
_LOCK_ALL: dict[tuple[bool, ...], Select[Any]] = {}


def _lock_all(flags: tuple[bool, ...]) -> Select[Any]:
    """One statement taking every lock, in order (PostgreSQL evaluates a select list left
    to right): one round trip however many locks a unit of work needs. Built once per
    shape: every create_queue of a new queue takes one."""
    statement = _LOCK_ALL.get(flags)
    if statement is None:
        statement = _LOCK_ALL[flags] = select(
            *(
                _LOCK_FUNCTION[exclusive](bindparam(f"k{index}", type_=BigInteger))
                for index, exclusive in enumerate(flags)
            )
        )
    return statement


Locks = Sequence[tuple[str, bool]]  # (name, exclusive), taken in this order


async def _take(executor: Executor, locks: Locks) -> None:
    flags = tuple(exclusive for _name, exclusive in locks)
    keys = {f"k{index}": lock_key(name) for index, (name, _e) in enumerate(locks)}
    await executor.execute(_lock_all(flags), keys)


@asynccontextmanager
async def guard_all(executor: Executor, locks: Locks) -> AsyncIterator[None]:
    """Hold the locks (name, exclusive), in the order given, until the transaction of
    `executor` (a session or a connection) ends; every caller lists shared keys in the
    same order.

    Commit or roll back inside the block: that releases them. A transaction still open
    when the block ends is rolled back. Shared holders do not wait for each other; an
    exclusive holder waits for all of them and they for it."""
    try:
        await _take(executor, locks)
        yield
    finally:
        if executor.in_transaction():
            await executor.rollback()


def guard(executor: Executor, name: str, *, exclusive: bool) -> AbstractAsyncContextManager[None]:
    """`guard_all` of one lock."""
    return guard_all(executor, [(name, exclusive)])


@asynccontextmanager
async def transaction_holding(engine: AsyncEngine, locks: Locks) -> AsyncIterator[AsyncConnection]:
    """A transaction on a connection of its own (committed when the block ends, rolled
    back if it raises) that holds the locks as `guard_all` does: for a unit of work on no
    session."""
    async with engine.begin() as connection:
        await _take(connection, locks)
        yield connection


@asynccontextmanager
async def job_lock(engine: AsyncEngine, job: str) -> AsyncIterator[bool]:
    """True when this caller may run `job`; False when another run (any replica) holds it.

    The lock lives in a transaction on a connection of its own, open for the whole run:
    the run's work uses other connections and commits as it goes without releasing it.
    """
    async with engine.connect() as connection:
        transaction = await connection.begin()
        try:
            acquired = bool(
                await connection.scalar(
                    select(func.pg_try_advisory_xact_lock(lock_key(job_key(job))))
                )
            )
            yield acquired
        finally:
            await transaction.rollback()
