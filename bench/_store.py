"""The intake's store of one single event, against asyncpg alone.

What docs/decisions/008-driver-path.md and 017-single-event-cost.md bought, and the figure
docs/benchmarks.md reports.

On a fresh, migrated PostgreSQL database with one offering, one agent with access and one
registered queue: `Outbox.store` for one event (the recipients query, then one statement
writing the event row and its delivery, the event counts when there are repeats, and the
connection's checkout from the engine's pool) in alternating blocks of 300, CPU of this
process per event (`time.process_time`), beside the same two statements (the package's
own, `outbox_postgres.RECIPIENTS` and `INSERT_ACCEPTED`) run on a connection of asyncpg's
own with rows made by hand (the floor). `Outbox.store` runs twice: with the recipients
read by every store (what the floor does), and as the service runs it, remembering them
(one round trip; docs/decisions/020-recipient-digest.md). Not part of `make bench`:

    python -m bench._store
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import uuid

import asyncpg
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from bench._support import alternating_blocks, bench_database, print_medians
from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Outbox, Request
from queuekeeper.events.outbox_postgres import (
    DELIVERY_COLUMNS,
    EVENT_COLUMNS,
    INSERT_ACCEPTED,
    RECIPIENTS,
    KeptConnection,
    column_values,
)
from queuekeeper.events.schemas import EventIn
from queuekeeper.logging import configure_logging
from queuekeeper.models import Base, utcnow

BLOCK = 300
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "8"))
TABLES = Base.metadata.tables
PAYLOAD = {"order_uuid": uuid.uuid4().hex, "padding": "x" * 600}


async def _seed(engine: AsyncEngine) -> uuid.UUID:
    offering, user, subscription = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    now = utcnow()
    async with engine.begin() as connection:
        # A user with a token: only such a user receives (docs/decisions/021).
        await connection.execute(
            insert(TABLES["users"]).values(
                uuid=user, username="bench", token_hash=hashlib.sha256(b"bench").hexdigest()
            )
        )
        await connection.execute(insert(TABLES["offerings"]).values(uuid=offering, name="o"))
        await connection.execute(
            insert(TABLES["offering_access"]).values(user_uuid=user, offering_uuid=offering)
        )
        await connection.execute(
            insert(TABLES["event_subscriptions"]).values(
                uuid=subscription, user_uuid=user, observable_objects=[], broker_state="ok"
            )
        )
        await connection.execute(
            insert(TABLES["event_subscription_queues"]).values(
                uuid=uuid.uuid4(),
                subscription_uuid=subscription,
                offering_uuid=offering,
                object_type="order",
                queue_name="subscription_bench",
                vhost="bench",
                created=now,
            )
        )
    return offering


async def _run(url: str) -> None:
    engine = db.create_engine(Settings(database_url=url))
    offering = await _seed(engine)
    floor = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    store = Outbox(engine, Settings(database_url=url))
    kept_connection = KeptConnection(engine)

    async def service(kept: KeptConnection | None = None) -> None:
        event = EventIn(
            event_id=uuid.uuid4().hex, offering_uuid=offering, object_type="order", payload=PAYLOAD
        )
        now = utcnow()
        await store.store([Request([event], [PAYLOAD], "")], now, store.lease("bench", now), kept)

    async def kept() -> None:
        await service(kept_connection)

    async def reading() -> None:
        store.recipients._entries.clear()
        await service()

    async def raw() -> None:
        event_id, now = uuid.uuid4().hex, utcnow()
        rows = await floor.fetch(RECIPIENTS[False], [offering], ["order"], now, [], [])
        recipient, digest = rows[0], rows[0][9]
        event = {
            "event_id": event_id,
            "offering_uuid": offering,
            "offering_uuids": None,
            "object_type": "order",
            "payload": json.dumps(PAYLOAD),  # as the store gives it
            "user_uuids": None,
            "queued": 1,
            "skipped_unregistered": 0,
            "accepted": now,
            "project_uuid": None,
            "subject_user_uuid": None,
        }
        copy = {
            "event_id": event_id,
            "queue_uuid": recipient[5],
            "consumer_uuid": None,
            "queue_name": recipient[7],
            "vhost": recipient[8],
            "offering_uuid": None,
            "state": "pending",
            "attempts": 1,
            "claimed_by": "bench",
            "claimed_until": now,
            "next_attempt_at": now,
            "created": now,
        }
        await floor.fetch(
            INSERT_ACCEPTED[False, True],  # the form for one event with one copy
            [offering],
            ["order"],
            now,
            [],
            [],
            digest,
            *column_values(event, EVENT_COLUMNS),
            *column_values(copy, DELIVERY_COLUMNS),
        )

    ways = {
        "Outbox.store, recipients remembered, connection kept (as the intake runs)": kept,
        "Outbox.store, recipients remembered, a checkout each": service,
        "Outbox.store, recipients read by each store": reading,
        "asyncpg alone, own connection": raw,
    }
    try:
        results = await alternating_blocks(ways, block=BLOCK, blocks=BLOCKS)
    finally:
        await kept_connection.release()
        await floor.close()
        await engine.dispose()
    print_medians(
        f"One single event stored, {BLOCKS} blocks of {BLOCK} each, CPU per event:", results
    )


def main() -> None:
    with open(os.devnull, "w") as sink, bench_database() as url:
        configure_logging(level="INFO", stream=sink)  # the intake's DEBUG lines cost nothing
        asyncio.run(_run(url))


if __name__ == "__main__":
    main()
