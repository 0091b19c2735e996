"""One token lookup three ways, in one run: what `db.read_one` costs.

The agent token lookup (`auth/repository.py`) on a fresh, migrated PostgreSQL database, in
alternating blocks of 500, CPU of this process per read (`time.process_time`): through an ORM
session in autocommit, through `db.read_one` (a Core connection in autocommit) as the code
does now, and asyncpg's `fetchrow` on a connection of its own (the floor). Not part of
`make bench`:

    python -m bench._reads
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
from sqlalchemy import bindparam, select

from bench._support import alternating_blocks, bench_database, print_medians
from queuekeeper import db
from queuekeeper.auth.repository import USER_WITH_TOKEN
from queuekeeper.auth.tokens import token_digest
from queuekeeper.config import Settings
from queuekeeper.models import User

BLOCK = 500
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "10"))
ORM_SELECT = select(User).where(User.token_hash == bindparam("digest"))


async def _run(url: str) -> None:
    settings = Settings(database_url=url)
    engine = db.create_engine(settings)
    sessions = db.create_sessionmaker(engine)
    token = secrets.token_hex(20)
    digest = token_digest(token)
    async with sessions() as session:
        session.add(User(uuid=uuid.uuid4(), username="bench", token_hash=digest))
        await session.commit()
    floor = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    core_statement = USER_WITH_TOKEN
    sql = str(core_statement.compile(dialect=engine.dialect))

    async def orm_session() -> object:
        async with sessions() as session:
            # What `db.read_without_transaction` did: no BEGIN, no COMMIT.
            await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            return await session.scalar(ORM_SELECT, {"digest": digest})

    async def read_one() -> object:
        return await db.read_one(engine, USER_WITH_TOKEN, {"digest": digest})

    async def plain_asyncpg() -> object:
        return await floor.fetchrow(sql, digest)

    reads = {
        "ORM session": orm_session,
        "db.read_one (now)": read_one,
        "asyncpg fetchrow, own connection": plain_asyncpg,
    }
    try:
        results = await alternating_blocks(
            {name: _finding(read) for name, read in reads.items()}, block=BLOCK, blocks=BLOCKS
        )
    finally:
        await floor.close()
        await engine.dispose()
    print_medians(
        f"One token lookup, {BLOCKS} blocks of {BLOCK} reads each, CPU per read:", results
    )


def _finding(read: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
    async def checked() -> None:
        assert await read() is not None  # every read must find the user

    return checked


def main() -> None:
    with bench_database() as url:
        asyncio.run(_run(url))


if __name__ == "__main__":
    main()
