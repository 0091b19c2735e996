"""Release of parked copies, and what parking costs the single-event path (contract §11).

Release: `queuekeeper serve` (relay and releaser in it) on a fresh database holding
BENCH_PARKED (100,000) parked copies for one queue; presence then says a consumer is back
while an aio-pika consumer takes every message off the queue (from BENCH_CONSUMER_DELAY
seconds on: a slow agent, so the queue fills to the bound). Measured: time to the first
message and to the last, copies per second, the service's peak RSS, the queue's deepest
ready count (sampled every 20 ms by a passive declare) against
QUEUEKEEPER_PARK_RELEASE_MAX_IN_FLIGHT, and whether every copy came once and in order.

Single-event path: what the relay's gate adds per batch (in process: one lock and one set
lookup per copy; no statement unless a copy parks), and the gate's refresh statement
(once per `park_check_interval` per replica) with the parked backlog in the table.

    .venv/bin/python -m bench parking
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import UTC, datetime

import aio_pika
import asyncpg
from sqlalchemy.ext.asyncio import create_async_engine

from bench._support import bench_database, free_port
from bench.publish import Service
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Claimed
from queuekeeper.parking.gate import ParkingGate

PARKED = int(os.environ.get("BENCH_PARKED", "100000"))
BOUND = int(os.environ.get("BENCH_PARK_BOUND", "1000"))
# Seconds the consumer waits after presence says it is back: the queue then fills to the
# bound and must stay there (a slow agent).
CONSUMER_DELAY = float(os.environ.get("BENCH_CONSUMER_DELAY", "0"))
AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _park(dsn: str, offering: uuid.UUID, vhost: str, queue: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        queue_uuid = await connection.fetchval(
            "SELECT uuid FROM event_subscription_queues WHERE queue_name = $1", queue
        )
        await connection.execute(
            """
            INSERT INTO events (event_id, offering_uuid, object_type, payload, queued,
                                skipped_unregistered, accepted)
            SELECT 'park-' || lpad(g::text, 7, '0'), $1, 'order',
                   json_build_object('order_uuid', md5(g::text)), 1, 0,
                   now() - interval '1 hour' + g * interval '1 millisecond'
            FROM generate_series(1, $2) g
            """,
            offering,
            PARKED,
        )
        await connection.execute(
            """
            INSERT INTO deliveries (event_id, queue_uuid, queue_name, vhost, state, attempts,
                                    next_attempt_at, created, parked_at, replay)
            SELECT 'park-' || lpad(g::text, 7, '0'), $1, $2, $3, 'parked', 0,
                   now(), now() - interval '1 hour', now() - interval '1 hour', false
            FROM generate_series(1, $4) g ORDER BY g
            """,
            queue_uuid,
            queue,
            vhost,
            PARKED,
        )
        await connection.execute("ANALYZE deliveries; ANALYZE events")
    finally:
        await connection.close()


async def _present(dsn: str, vhost: str, queue: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(
            "INSERT INTO queue_presence (vhost, queue_name, consumers, away_since, changed) "
            "VALUES ($1, $2, 1, NULL, $3)",
            vhost,
            queue,
            datetime.now(UTC),
        )
    finally:
        await connection.close()


async def release(settings: Settings, dsn: str) -> None:
    os.environ["QUEUEKEEPER_PARK_RELEASE_MAX_IN_FLIGHT"] = str(BOUND)
    service = Service(settings, free_port())
    await service.start()
    try:
        offering = uuid.uuid4()
        await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "bench"})
        [(vhost, queue)] = await service.queues(offering, 1)
        started = time.perf_counter()
        await _park(dsn, offering, vhost, queue)
        print(f"{PARKED} parked copies written in {time.perf_counter() - started:.1f} s")
        assert service.process is not None
        rss_before = _rss_mib(service.process.pid)

        connection = await aio_pika.connect(AMQP.rstrip("/") + "/" + vhost)
        received: list[str] = []
        done = asyncio.Event()
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=500)
            declared = await channel.declare_queue(queue, passive=True)

            async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                received.append(str(message.message_id))
                await message.ack()
                if len(received) >= PARKED:
                    done.set()

            probe = await connection.channel()
            deepest, peak_rss = 0, rss_before
            began = time.perf_counter()
            await _present(dsn, vhost, queue)
            first_at: float | None = None
            consuming = False
            while not done.is_set() and time.perf_counter() - began < 1800:
                if not consuming and time.perf_counter() - began >= CONSUMER_DELAY:
                    await declared.consume(take)
                    consuming = True
                depth = (await probe.declare_queue(queue, passive=True)).declaration_result
                deepest = max(deepest, depth.message_count or 0)
                peak_rss = max(peak_rss, _rss_mib(service.process.pid))
                if first_at is None and received:
                    first_at = time.perf_counter() - began
                await asyncio.sleep(0.02)
            took = time.perf_counter() - began
        in_order = received == sorted(received)
        print(
            f"consumer from {CONSUMER_DELAY:g} s; "
            f"released {len(received)} of {PARKED} in {took:.1f} s "
            f"({len(received) / took:.0f}/s); first after {first_at or 0:.2f} s; "
            f"queue depth max {deepest} (bound {BOUND}); "
            f"service RSS {rss_before:.0f} -> peak {peak_rss:.0f} MiB; "
            f"each once: {len(set(received)) == len(received) == PARKED}; in order: {in_order}"
        )
    finally:
        await service.stop()
    await _gate_refresh_cost(settings)


async def _gate_refresh_cost(settings: Settings) -> None:
    """The refresh statement with a parked backlog of PARKED rows for another queue."""
    from queuekeeper.db import create_engine

    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            await connection.exec_driver_sql(
                "UPDATE deliveries SET state = 'parked' WHERE event_id LIKE 'park-%'"
            )
            await connection.commit()
        gate = ParkingGate(settings, engine)
        await gate.refresh()
        rounds = 50
        started = time.perf_counter()
        for _ in range(rounds):
            await gate.refresh()
        each = (time.perf_counter() - started) / rounds
        print(
            f"gate refresh with {PARKED} parked rows: {each * 1000:.2f} ms per statement "
            f"(once per park_check_interval per replica)"
        )
    finally:
        await engine.dispose()


async def gate_cost() -> None:
    """Per batch of one (the single-event path): hold_back with nothing held, and with
    1,000 other queues held."""
    settings = Settings()  # its default URL: nothing connects
    engine = create_async_engine(settings.database_url)  # no statement is run on it
    gate = ParkingGate(settings, engine)
    gate._read_at = float("inf")  # never stale: the view below is what it decides by
    now = datetime.now(UTC)
    copy = Claimed(
        1, "e", uuid.uuid4(), None, "q", "v", 1, now, None, None, uuid.uuid4(), "order", now, "{}"
    )
    for label, held in (
        ("nothing held", frozenset()),
        ("1,000 other queues held", frozenset((f"v{n}", f"q{n}") for n in range(1000))),
    ):
        gate.held = held
        rounds = 200_000
        started = time.perf_counter()
        for _ in range(rounds):
            await gate.hold_back("relay", [copy])
        each = (time.perf_counter() - started) / rounds
        print(f"hold_back, one copy, {label}: {each * 1e6:.2f} us per batch")
    await engine.dispose()


def main() -> None:
    asyncio.run(gate_cost())
    with bench_database() as url:
        settings = Settings(database_url=url, instance_name=f"qkb-{uuid.uuid4().hex[:8]}")
        dsn = url.replace("postgresql+asyncpg://", "postgresql://")
        asyncio.run(release(settings, dsn))


if __name__ == "__main__":
    main()
