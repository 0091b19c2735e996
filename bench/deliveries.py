"""A consumer's deliveries list with a million copies (contract §14, decision 031).

A fresh database holds one webhook consumer (owned by a staff user, pointing at a port
nothing listens on, its copies all settled, so the dispatcher posts nothing) with
BENCH_DELIVERIES_COPIES (1,000,000) copies of as many events, written by one
`INSERT ... SELECT generate_series` each (every 100th copy given up, the rest delivered;
half the events `order`, half `resource`), then `VACUUM ANALYZE` as autovacuum would leave
them. `queuekeeper serve` answers; each page is timed from the request to the last byte,
BENCH_DELIVERIES_CALLS (50) times after 5 to warm up:

- the first page (`page_size` 100, newest first, with its `X-Result-Count`);
- a page filtered by state (`state=given_up`: 1 copy in 100);
- a page filtered by the event (`object_type=resource`);

and, as the floor every consumer route stands on (authentication, the consumer read), the
consumer itself (`GET /api/event-consumers/{uuid}/`). Printed: p50/p90/p99 of each, the
database's own time for each page's two statements (EXPLAIN ANALYZE), and the fill's time.

    .venv/bin/python -m bench deliveries
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
    'whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3', '', now(), now())
""",
    """
INSERT INTO events (event_id, object_type, payload, queued, skipped_unregistered, accepted)
SELECT 'bench-' || n, CASE WHEN n % 2 = 0 THEN 'order' ELSE 'resource' END, '{}'::json, 1, 0,
       now() - make_interval(secs => ($1 - n) / 1000.0)
FROM generate_series(1, $1) AS n
""",
    """
INSERT INTO deliveries (event_id, consumer_uuid, queue_name, vhost, state, attempts,
    next_attempt_at, created, finished, webhook, last_attempt_at, last_status,
    given_up_reason, attempt_log)
SELECT 'bench-' || n, $2::uuid, 'webhook_' || replace($2::uuid::text, '-', ''),
       replace($1::uuid::text, '-', ''),
       CASE WHEN n % 100 = 0 THEN 'given_up' ELSE 'published' END, 1, t, t, t, true, t,
       CASE WHEN n % 100 = 0 THEN '503' ELSE '200' END,
       CASE WHEN n % 100 = 0 THEN 'retention' END,
       jsonb_build_array(jsonb_build_object('at', t, 'duration_ms', 12, 'status', 200,
                                            'error', NULL))
FROM generate_series(1, $3) AS n, LATERAL (SELECT now() - make_interval(secs => ($3 - n)
                                                   / 1000.0) AS t) AS at
""",
]


async def _fill(settings: Settings, owner: uuid.UUID, consumer: uuid.UUID) -> float:
    started = time.perf_counter()
    dsn = settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(dsn)
    try:
        users, consumers, events, copies = _FILL
        await connection.execute(users, owner)
        await connection.execute(consumers, owner, consumer)
        await connection.execute(events, COPIES)
        await connection.execute(copies, owner, consumer, COPIES)
        await connection.execute("VACUUM ANALYZE events")
        await connection.execute("VACUUM ANALYZE deliveries")
    finally:
        await connection.close()
    return time.perf_counter() - started


# The statements `consumers/repository.py` `copies_page` runs, for EXPLAIN ANALYZE.
_PAGE = """
SELECT d.id, d.event_id, e.object_type, e.accepted, d.state, d.replay, d.attempts,
       d.last_attempt_at, d.next_attempt_at, d.finished, d.last_status, d.last_error,
       d.given_up_reason, d.webhook
FROM deliveries d JOIN events e ON e.event_id = d.event_id
WHERE d.consumer_uuid = $1 {where} ORDER BY d.id DESC LIMIT 100
"""
_COUNT = (
    "SELECT count(*) FROM (SELECT 1 FROM deliveries d {join} WHERE d.consumer_uuid = $1 {where}"
    " LIMIT 10001) c"
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
            plan = await connection.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", consumer)
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
        assert answer.json(), f"an empty page for {params}"
        if call >= WARM_UP:
            samples.append(took)
    return samples


async def run(settings: Settings) -> None:
    owner, consumer = uuid.uuid4(), uuid.uuid4()
    filled = await _fill(settings, owner, consumer)
    print(f"filled {COPIES:,} copies of one consumer in {filled:.1f} s", flush=True)
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
            baseline = percentiles(await _timed(http, path.removesuffix("deliveries/"), {}))
            print(f"{'GET the consumer':<22} {fmt_ms(baseline)}  (the route's floor)", flush=True)
            for title, params in (
                ("first page", {}),
                ("state=given_up", {"state": "given_up"}),
                ("object_type=resource", {"object_type": "resource"}),
            ):
                stats = percentiles(await _timed(http, path, params))
                verdict = "within" if stats["p50"] < BUDGET_SECONDS else "OVER"
                database = await _database_ms(settings, consumer, title)
                print(f"{title:<22} {fmt_ms(stats)}  (p50 {verdict} 50 ms; {database})", flush=True)


def main() -> None:
    async def with_token(settings: Settings) -> None:
        await run(settings.model_copy(update={"service_tokens": [SERVICE_TOKEN]}))

    on_a_bench_database(with_token)


if __name__ == "__main__":
    main()
