"""The store's one write (`outbox_postgres.INSERT_ACCEPTED`) in its two forms: arrays for a
group, one value per column for one event with one copy
(docs/decisions/017-single-event-cost.md). Both must write the same rows."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import httpx
from fastapi import FastAPI

from queuekeeper.events.outbox_postgres import (
    DELIVERY_COLUMNS,
    EVENT_COLUMNS,
    INSERT_ACCEPTED,
    RECIPIENTS,
    checked_out,
    column_arrays,
    column_values,
)
from queuekeeper.models import utcnow
from tests.events.support import order_event, post_batch, post_event, register
from tests.helpers import Backend, database_statements


def _rows(recipient: Any, now: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    event_id = uuid.uuid4().hex
    later = now + timedelta(days=1)  # held, and not due: no relay of the app takes it
    # Every column given: a value where the row has one, else None.
    event = dict.fromkeys(EVENT_COLUMNS) | {
        "event_id": event_id,
        "offering_uuid": recipient["uuid"],
        "offering_uuids": [recipient["uuid"].hex],
        "object_type": "order",
        "payload": json.dumps({"order_uuid": event_id}),
        "user_uuids": [recipient["user_uuid"].hex],
        "queued": 1,
        "skipped_unregistered": 0,
        "accepted": now,
    }
    copy = dict.fromkeys(DELIVERY_COLUMNS) | {
        "event_id": event_id,
        "queue_uuid": recipient["queue_uuid"],
        "queue_name": recipient["queue_name"],
        "vhost": recipient["vhost"],
        "offering_uuid": recipient["uuid"],
        "state": "pending",
        "attempts": 1,
        "claimed_by": "test",
        "claimed_until": later,
        "next_attempt_at": later,
        "created": now,
    }
    return event, copy


def _object(value: Any) -> Any:
    # The engine's connections decode json themselves (SQLAlchemy's codec); asyncpg would not.
    return json.loads(value) if isinstance(value, str) else value


async def test_one_event_with_one_copy_is_written_as_the_arrays_would_write_it(
    app: FastAPI, backend: Backend
) -> None:
    registered = await register(backend)
    engine = app.state.queuekeeper.engine
    now = utcnow()
    async with checked_out(engine) as driver:
        (recipient,) = await driver.fetch(
            RECIPIENTS[False], [registered.offering], ["order"], now, [], []
        )
        digest = recipient[-1]
        written = []
        for one in (False, True):
            event, copy = _rows(recipient, now)
            values = (
                [*column_values(event, EVENT_COLUMNS), *column_values(copy, DELIVERY_COLUMNS)]
                if one
                else [
                    *column_arrays([event], EVENT_COLUMNS),
                    *column_arrays([copy], DELIVERY_COLUMNS),
                ]
            )
            returned = await driver.fetch(
                INSERT_ACCEPTED[False, one],
                [registered.offering],
                ["order"],
                now,
                [],
                [],
                digest,
                *values,
            )
            assert sorted(row[0] for row in returned) == ["d", "e", "g"]
            (stored,) = await driver.fetch(
                "SELECT to_jsonb(e) - 'event_id' - 'payload' AS event, to_jsonb(d) - 'id'"
                " - 'event_id' AS copy, e.payload::text AS payload"
                " FROM events e JOIN deliveries d USING (event_id) WHERE event_id = $1",
                event["event_id"],
            )
            assert json.loads(stored["payload"]) == {"order_uuid": event["event_id"]}
            written.append((_object(stored["event"]), _object(stored["copy"])))
    arrays, values = written
    assert values == arrays
    assert arrays[0]["user_uuids"] == [registered.agent.uuid.hex]
    assert arrays[1]["queue_uuid"] == str(recipient["queue_uuid"])
    assert arrays[1]["claimed_by"] == "test"


async def test_a_single_event_takes_the_one_value_form_and_a_group_the_arrays(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    engine = app.state.queuekeeper.engine
    forms = {text: key for key, text in INSERT_ACCEPTED.items()}
    single = order_event(registered.offering)
    group = [order_event(registered.offering), order_event(registered.offering)]
    used = []
    for send in (lambda: post_event(client, single), lambda: post_batch(client, group)):
        with database_statements(engine, own_only=True) as statements:
            response = await send()
        assert response.status_code == 202, response.text
        used.append([forms[s] for s in statements if s in forms])
    assert used == [[(False, True)], [(False, False)]]
