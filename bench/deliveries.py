"""A consumer's deliveries list, answer and status with a million copies (contract §14,
decision 031).

A fresh database holds two consumers of one staff owner, each with BENCH_DELIVERIES_COPIES
(1,000,000) copies of the same events: a webhook consumer (pointing at a port nothing
listens on, its copies all settled, so the dispatcher posts nothing) and a queue consumer
(its queue not on the broker). Written by one `INSERT ... SELECT generate_series` each
(every 100th copy given up, the rest delivered; half the events `order`, half `resource`),
then `VACUUM ANALYZE` as autovacuum would leave them. `queuekeeper serve` answers; each
route is timed from the request to the last byte, BENCH_DELIVERIES_CALLS (50) times after
5 to warm up, and so is its raw baseline in the same run: the bare statements its answer
needs, on one asyncpg connection (prepared, as the service's are):

- the first page of the webhook consumer's deliveries (`page_size` 100, newest first, with
  its `X-Result-Count`), against the page's and the count's statements;
- pages filtered by state (`state=given_up`: 1 copy in 100) and by the event
  (`object_type=resource`), with the database's own time (EXPLAIN ANALYZE);
- each consumer (`GET /api/event-consumers/{uuid}/`), its `/status/` (the queue
  consumer's asks the broker's Management API as well) and the list of consumers, against
  the consumer's row and its last delivered copy.

Printed: p50/p90/p99 of each, its ratio to raw at p50, and a GOAL line for the first page
(p50 under 50 ms).

    BENCH_START_SECONDS=180 .venv/bin/python -m bench deliveries
"""

from __future__ import annotations

import json
import os
import time
import uuid

import asyncpg
import httpx

from bench._support import SERVICE_TOKEN, fmt_ms, live_process, on_a_bench_database, percentiles
from queuekeeper.config import Settings

COPIES = int(os.environ.get("BENCH_DELIVERIES_COPIES", "1000000"))
CALLS = int(os.environ.get("BENCH_DELIVERIES_CALLS", "50"))
WARM_UP = 5
# What the list must answer within (the contract's budget for the first page).
BUDGET_SECONDS = 0.050

_FILL = [
    """
INSERT INTO users (uuid, username, email, full_name, is_active, is_staff, is_support,
                   token_hash, created, modified)
VALUES ($1, 'bench-staff', '', '', true, true, false, NULL, now(), now())
""",
    """
INSERT INTO event_consumers (uuid, user_uuid, object_types, queue_name, vhost, broker_state,
    auth_token_prefix, is_global, payload_filters, delivery, webhook_url, webhook_secret,
    last_error, created, modified)
VALUES ($2::uuid, $1::uuid, '[]', 'webhook_' || replace($2::uuid::text, '-', ''),
    replace($1::uuid::text, '-', ''),
    'ok', '', true, '{}', 'webhook', 'http://127.0.0.1:9/hook',
    'whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3', '', now(), now()),
    ($3::uuid, $1::uuid, '[]', 'consumer_' || replace($3::uuid::text, '-', ''),
    replace($1::uuid::text, '-', ''), 'ok', '', true, '{}', 'rmq', NULL, NULL, '', now(), now())
""",
    """
INSERT INTO events (event_id, object_type, payload, queued, skipped_unregistered, accepted)
SELECT 'bench-' || n, CASE WHEN n % 2 = 0 THEN 'order' ELSE 'resource' END, '{}'::json, 1, 0,
       now() - make_interval(secs => ($1 - n) / 1000.0)
FROM generate_series(1, $1) AS n
""",
    # $4: the queue name's prefix, $5: whether a webhook's, $6: the delivered status.
    """
INSERT INTO deliveries (event_id, consumer_uuid, queue_name, vhost, state, attempts,
    next_attempt_at, created, finished, webhook, last_attempt_at, last_status,
    given_up_reason, attempt_log)
SELECT 'bench-' || n, $2::uuid, $4::text || replace($2::uuid::text, '-', ''),
       replace($1::uuid::text, '-', ''),
       CASE WHEN n % 100 = 0 THEN 'given_up' ELSE 'published' END, 1, t, t, t, $5::boolean, t,
       CASE WHEN n % 100 = 0 THEN '503' ELSE $6::text END,
       CASE WHEN n % 100 = 0 THEN 'retention' END,
       jsonb_build_array(jsonb_build_object('at', t, 'duration_ms', 12, 'status', $6::text,
                                            'error', NULL))
FROM generate_series(1, $3) AS n, LATERAL (SELECT now() - make_interval(secs => ($3 - n)
                                                   / 1000.0) AS t) AS at
""",
]


async def _fill(
    settings: Settings, owner: uuid.UUID, consumer: uuid.UUID, queue: uuid.UUID
) -> float:
    started = time.perf_counter()
    dsn = settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(dsn)
    try:
        users, consumers, events, copies = _FILL
        await connection.execute(users, owner)
        await connection.execute(consumers, owner, consumer, queue)
        await connection.execute(events, COPIES)
        await connection.execute(copies, owner, consumer, COPIES, "webhook_", True, "200")
        await connection.execute(copies, owner, queue, COPIES, "consumer_", False, "confirmed")
        await connection.execute("VACUUM ANALYZE events")
        await connection.execute("VACUUM ANALYZE deliveries")
    finally:
        await connection.close()
    return time.perf_counter() - started


# The statements `consumers/repository.py` `copies_page` runs, for EXPLAIN ANALYZE and as
# the first page's raw baseline (the consumer as a one-element array: see `_copy_filters`).
_PAGE = """
SELECT d.id, d.event_id, e.object_type, e.accepted, d.state, d.replay, d.attempts,
       d.last_attempt_at, d.next_attempt_at, d.finished, d.last_status, d.last_error,
       d.given_up_reason, d.webhook
FROM deliveries d JOIN events e ON e.event_id = d.event_id
WHERE d.consumer_uuid = ANY($1::uuid[]) {where}
ORDER BY d.consumer_uuid DESC, d.id DESC LIMIT 101
"""
_COUNT = (
    "SELECT count(*) FROM (SELECT 1 FROM deliveries d {join}"
    " WHERE d.consumer_uuid = ANY($1::uuid[]) {where} LIMIT 10001) c"
)
_WHERE = {
    "first page": ("", ""),
    "state=given_up": ("AND d.state IN ('given_up', 'rejected')", ""),
    "object_type=resource": (
        "AND e.object_type = 'resource'",
        "JOIN events e ON e.event_id = d.event_id",
    ),
}


async def _database_ms(settings: Settings, consumer: uuid.UUID, title: str) -> str:
    where, join = _WHERE[title]
    dsn = settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(dsn)
    try:
        took = []
        for sql in (_PAGE.format(where=where), _COUNT.format(join=join, where=where)):
            plan = await connection.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", [consumer])
            took.append(json.loads(plan)[0]["Execution Time"])
    finally:
        await connection.close()
    return f"database: page {took[0]:.1f} ms, count {took[1]:.1f} ms"


async def _timed(http: httpx.AsyncClient, path: str, params: dict[str, str]) -> list[float]:
    samples: list[float] = []
    for call in range(WARM_UP + CALLS):
        started = time.perf_counter()
        answer = await http.get(path, params=params)
        took = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        assert answer.json(), f"an empty answer for {path} {params}"
        if call >= WARM_UP:
            samples.append(took)
    return samples


# The raw baselines: the bare statements each answer needs. The first page: its rows (one
# more, to know whether a page follows) and its count; a consumer: its row and when a copy
# of it was last confirmed (`consumers/repository.py` `last_delivered`).
_RAW_PAGE = (_PAGE.format(where=""), _COUNT.format(join="", where=""))
_RAW_CONSUMER = (
    "SELECT * FROM event_consumers WHERE uuid = $1",
    "SELECT max(finished) FROM deliveries"
    " WHERE coalesce(queue_uuid, consumer_uuid) = $1 AND state = 'published'",
)


async def _raw(
    connection: asyncpg.Connection, statements: tuple[str, str], argument: object
) -> list[float]:
    prepared = [await connection.prepare(sql) for sql in statements]
    samples: list[float] = []
    for call in range(WARM_UP + CALLS):
        started = time.perf_counter()
        for statement in prepared:
            await statement.fetch(argument)
        if call >= WARM_UP:
            samples.append(time.perf_counter() - started)
    return samples


def _line(title: str, stats: dict[str, float], raw: dict[str, float], note: str = "") -> str:
    ratio = stats["p50"] / raw["p50"]
    return (
        f"{title:<22} {fmt_ms(stats)}  raw p50 {raw['p50'] * 1000:5.2f} ms p99 "
        f"{raw['p99'] * 1000:5.2f} ms  {ratio:5.1f}x raw{note}"
    )


async def run(settings: Settings) -> None:
    owner, consumer, queue = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    filled = await _fill(settings, owner, consumer, queue)
    print(f"filled {COPIES:,} copies of each of two consumers in {filled:.1f} s", flush=True)
    dsn = settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(dsn)
    try:
        first_page, raw_page = await _measure(settings, connection, consumer, queue)
    finally:
        await connection.close()
    met = "met" if first_page["p50"] < BUDGET_SECONDS else "NOT met"
    print(
        f"GOAL deliveries first page of {COPIES:,} copies p50 {first_page['p50'] * 1000:.1f} ms"
        f" (p99 {first_page['p99'] * 1000:.1f} ms, raw p50 {raw_page['p50'] * 1000:.2f} ms):"
        f" goal < {BUDGET_SECONDS * 1000:.0f} ms {met}",
        flush=True,
    )


async def _measure(
    settings: Settings, connection: asyncpg.Connection, consumer: uuid.UUID, queue: uuid.UUID
) -> tuple[dict[str, float], dict[str, float]]:
    """Each route against its raw baseline; the first page's and its baseline's figures."""
    path = f"/api/event-consumers/{consumer.hex}/deliveries/"
    # One process (an accept worker with the relay inside): what answers is what is timed,
    # and it starts within the harness's wait on a busy machine.
    with live_process(
        settings, QUEUEKEEPER_ACCEPT_WORKERS="1", QUEUEKEEPER_RELAY_PROCESSES="0"
    ) as (base, _process):
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {SERVICE_TOKEN}"}, timeout=60
        ) as http:
            first = await http.get(path)
            print(f"X-Result-Count {first.headers['X-Result-Count']}", flush=True)
            raw_page = percentiles(await _raw(connection, _RAW_PAGE, [consumer]))
            stats = percentiles(await _timed(http, path, {}))
            database = await _database_ms(settings, consumer, "first page")
            print(_line("first page", stats, raw_page, f"  ({database})"), flush=True)
            first_page = stats
            for title, params in (
                ("state=given_up", {"state": "given_up"}),
                ("object_type=resource", {"object_type": "resource"}),
            ):
                stats = percentiles(await _timed(http, path, params))
                database = await _database_ms(settings, consumer, title)
                print(f"{title:<22} {fmt_ms(stats)}  ({database})", flush=True)
            for title, route, key, note in (
                ("GET webhook consumer", f"/api/event-consumers/{consumer.hex}/", consumer, ""),
                ("GET queue consumer", f"/api/event-consumers/{queue.hex}/", queue, ""),
                ("status, webhook", f"/api/event-consumers/{consumer.hex}/status/", consumer, ""),
                (
                    "status, queue",
                    f"/api/event-consumers/{queue.hex}/status/",
                    queue,
                    "  (with the broker's Management API calls)",
                ),
                ("list of consumers", "/api/event-consumers/", queue, "  (both consumers)"),
            ):
                raw = percentiles(await _raw(connection, _RAW_CONSUMER, key))
                stats = percentiles(await _timed(http, route, {}))
                print(_line(title, stats, raw, note), flush=True)
    return first_page, raw_page


def main() -> None:
    async def with_token(settings: Settings) -> None:
        await run(settings.model_copy(update={"service_tokens": [SERVICE_TOKEN]}))

    on_a_bench_database(with_token)


if __name__ == "__main__":
    main()
