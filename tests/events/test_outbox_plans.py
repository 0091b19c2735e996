"""The relay's by-id statements read the copies they name, however large the backlog.

After a burst, PostgreSQL's statistics still say what they said when nearly every copy
was published: pending copies are few. A statement guarded by `state = 'pending'` was then
planned through the partial index of pending copies, reading the whole backlog for each
settled batch (docs/decisions/018-outbox-plans.md). Each statement is planned here as the
relay runs it (prepared, its parameters bound) in exactly that situation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from queuekeeper.config import Settings
from queuekeeper.events import outbox_postgres as statements

PENDING_INDEX = "ix_deliveries_pending_due"
PUBLISHED, BACKLOG = 2_000, 5_000


@pytest.fixture
async def after_a_burst(settings: Settings, clean_state: None) -> AsyncIterator[Any]:
    """Statistics taken over published copies, then a backlog of pending ones."""
    connection = await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))
    try:
        await connection.execute(
            "INSERT INTO events (event_id, offering_uuid, object_type, payload, queued, "
            "skipped_unregistered, accepted) SELECT 'e' || g, $1, 'order', '{}'::json, 1, 0, "
            "now() FROM generate_series(1, $2) g",
            uuid.uuid4(),
            PUBLISHED + BACKLOG,
        )
        copies = (
            "INSERT INTO deliveries (event_id, queue_name, vhost, state, attempts, "
            "next_attempt_at, created, claimed_by) SELECT 'e' || g, 'q', 'v', $3, 1, now(), "
            "now(), 'relay-1' FROM generate_series($1::int, $2::int) g"
        )
        await connection.execute(copies, 1, PUBLISHED, "published")
        await connection.execute("ANALYZE deliveries")
        await connection.execute(copies, PUBLISHED + 1, PUBLISHED + BACKLOG, "pending")
        yield connection
    finally:
        await connection.close()


def _indexes(plan: Any) -> set[str]:
    found = {plan["Index Name"]} if "Index Name" in plan else set()
    for child in plan.get("Plans", ()):
        found |= _indexes(child)
    return found


async def _plan(connection: Any, sql: str, *arguments: Any) -> set[str]:
    """The indexes the statement's plan reads, for the custom and the generic plan alike."""
    found: set[str] = set()
    for mode in ("force_custom_plan", "force_generic_plan"):
        await connection.execute(f"SET plan_cache_mode = {mode}")
        statement = await connection.prepare(f"EXPLAIN (FORMAT JSON) {sql}")
        document = json.loads(await statement.fetchval(*arguments))
        found |= _indexes(document[0]["Plan"])
    await connection.execute("RESET plan_cache_mode")
    return found


async def _some_ids(connection: Any) -> list[int]:
    rows = await connection.fetch(
        "SELECT id FROM deliveries WHERE state = 'pending' ORDER BY id LIMIT 20"
    )
    return [row[0] for row in rows]


async def test_the_plain_state_guard_reads_the_backlog_here(after_a_burst: Any) -> None:
    """The situation is the one that went wrong: the index's own predicate (`state = 'pending'`,
    of the queue relay's copies) picks the index."""
    ids = await _some_ids(after_a_burst)
    plain = (
        "UPDATE deliveries SET finished = $2 WHERE id = ANY($1::bigint[])"
        " AND state = 'pending' AND NOT webhook"
    )
    assert PENDING_INDEX in await _plan(after_a_burst, plain, ids, datetime.now(UTC))


async def test_settling_renewing_releasing_parking_and_judging_by_id_never_read_the_backlog(
    after_a_burst: Any,
) -> None:
    ids = await _some_ids(after_a_burst)
    now = datetime.now(UTC)
    cases = {
        "FINISH": (statements.FINISH, ids, "published", now, None, "confirmed", [3] * len(ids)),
        "PUBLISHED_AT": (statements.PUBLISHED_AT, ids, [now] * len(ids), [3] * len(ids)),
        "RENEW": (statements.RENEW, ids, "relay-1", now),
        "RELEASE": (statements.RELEASE, ids, "relay-1", now, "queuekeeper_outbox_due"),
        "PARK": (statements.PARK, ids, "relay-1", now, "away"),
        "GIVE_UP": (
            statements.GIVE_UP,
            ids,
            ["gone"] * len(ids),
            now,
            ["queue_gone"] * len(ids),
            [None] * len(ids),
            [None] * len(ids),
            [None] * len(ids),
        ),
        "RESCHEDULE": (
            statements.RESCHEDULE,
            ids,
            [now] * len(ids),
            ["x"] * len(ids),
            "r",
            [now] * len(ids),
            [3] * len(ids),
            ["nacked"] * len(ids),
        ),
        "JUDGE_HELD": (statements.JUDGE_HELD, ids, "relay-1", now),
    }
    for name, (sql, *arguments) in cases.items():
        indexes = await _plan(after_a_burst, sql, *arguments)
        assert PENDING_INDEX not in indexes, f"{name} reads the backlog: {indexes}"
