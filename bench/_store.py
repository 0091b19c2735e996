"""The intake's store of one single event, against asyncpg alone.

What docs/decisions/008-driver-path.md and 017-single-event-cost.md bought, and the figure
docs/benchmarks.md reports.

On a fresh, migrated PostgreSQL database with one offering, one agent with access and one
registered queue: `Outbox.store` for one event (the recipients query, then one statement
writing the event row and its delivery, the event counts when there are repeats, and the
connection's checkout from the engine's pool) in alternating blocks of 300, CPU of this
process per event (`time.process_time`), beside the same two round trips written by hand
on a connection of asyncpg's own (the floor: the recipients, then one statement inserting
the event and its delivery). `Outbox.store` runs twice: with the recipients read by every
store (what the floor does), and as the service runs it, remembering them (one round trip;
docs/decisions/020-recipient-digest.md). Not part of `make bench`:

    python -m bench._store
"""

from __future__ import annotations

import asyncio
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
from queuekeeper.events.schemas import EventIn
from queuekeeper.logging import configure_logging
from queuekeeper.models import Base, utcnow

BLOCK = 300
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "8"))
TABLES = Base.metadata.tables
PAYLOAD = {"order_uuid": uuid.uuid4().hex, "padding": "x" * 600}

RECIPIENTS = """
SELECT o.uuid, s.uuid, q.uuid, q.queue_name, q.vhost
FROM offerings o
LEFT JOIN offering_access a ON a.offering_uuid = o.uuid
JOIN users u ON u.uuid = a.user_uuid AND u.is_active
  AND (u.token_expires_at IS NULL OR u.token_expires_at > $2)
JOIN event_subscriptions s ON s.user_uuid = a.user_uuid
LEFT JOIN event_subscription_queues q ON q.subscription_uuid = s.uuid
  AND q.offering_uuid = o.uuid AND q.object_type = ANY($3)
WHERE o.uuid = ANY($1)
"""
# The event and its delivery in one statement, as the store writes them.
INSERT_ACCEPTED = """
WITH new_event AS (
  INSERT INTO events (event_id, offering_uuid, object_type, payload, user_uuids, queued,
    skipped_unregistered, accepted)
  VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING RETURNING event_id
)
INSERT INTO deliveries (event_id, queue_uuid, consumer_uuid, queue_name, vhost, state,
  attempts, claimed_by, claimed_until, next_attempt_at, created)
SELECT event_id, $9, NULL, $10, $11, 'pending', 1, 'bench', $12, $12, $12 FROM new_event
RETURNING id, event_id, queue_uuid, consumer_uuid
"""


async def _seed(engine: AsyncEngine) -> uuid.UUID:
    offering, user, subscription = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    now = utcnow()
    async with engine.begin() as connection:
        await connection.execute(insert(TABLES["users"]).values(uuid=user, username="bench"))
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

    async def service() -> None:
        event = EventIn(
            event_id=uuid.uuid4().hex, offering_uuid=offering, object_type="order", payload=PAYLOAD
        )
        now = utcnow()
        await store.store([Request([event], [PAYLOAD], "")], now, store.lease("bench", now))

    async def reading() -> None:
        store.statements.recipients._entries.clear()  # type: ignore[attr-defined]
        await service()

    async def raw() -> None:
        event_id, now = uuid.uuid4().hex, utcnow()
        rows = await floor.fetch(RECIPIENTS, [offering], now, ["order"])
        await floor.fetch(
            INSERT_ACCEPTED,
            event_id,
            offering,
            "order",
            json.dumps(PAYLOAD),
            None,
            1,
            0,
            now,
            rows[0][2],
            rows[0][3],
            rows[0][4],
            now,
        )

    ways = {
        "Outbox.store, recipients remembered": service,
        "Outbox.store, recipients read by each store": reading,
        "asyncpg alone, own connection": raw,
    }
    try:
        results = await alternating_blocks(ways, block=BLOCK, blocks=BLOCKS)
    finally:
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
