"""Every consumer answer carries what waldur-api-client 8.1.4 requires (contract §12):
`delivery`, `webhook_destination`, `payload_filters`, `last_delivered_at`, `last_error`,
`last_error_at`, and a `delivery_blocked_reason` the database alone can tell."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.models import utcnow
from tests.consumers.test_event_consumers_api import CONSUMERS, SERVICE, register
from tests.events.support import order_event, post_event
from tests.helpers import Backend, database_statements
from tests.parking.support import set_presence

FIELDS_814 = {
    "delivery",
    "webhook_destination",
    "payload_filters",
    "last_delivered_at",
    "last_error",
    "last_error_at",
}


async def test_the_814_fields_on_register_list_and_retrieve(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    registered = await register(agent, {"scopes": [{"type": "offering", "uuid": offering.hex}]})
    assert registered.status_code == 201, registered.text
    answer = registered.json()
    assert set(answer) >= FIELDS_814 | {"rmq_username", "queue_name", "delivery_blocked_reason"}
    assert (answer["delivery"], answer["webhook_destination"], answer["payload_filters"]) == (
        "rmq",
        None,
        {},
    )
    assert (answer["last_delivered_at"], answer["last_error"], answer["last_error_at"]) == (
        None,
        "",
        None,
    )
    assert answer["delivery_blocked_reason"] is None

    before = utcnow()
    sent = await post_event(client, order_event(offering), wait=True)
    assert sent.json()["deliveries"][0]["state"] == "published", sent.text
    (listed,) = (await client.get(CONSUMERS, headers=agent.headers)).json()
    delivered = datetime.fromisoformat(listed["last_delivered_at"])
    assert before <= delivered <= utcnow()
    one = (await client.get(f"{CONSUMERS}{listed['uuid']}/", headers=agent.headers)).json()
    assert one == listed
    again = (await register(agent, {"scopes": [{"type": "offering", "uuid": offering.hex}]})).json()
    assert again["last_delivered_at"] == listed["last_delivered_at"]


async def test_the_delivery_filter(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering = await backend.agent_with_offering()
    await register(agent, {"scopes": [{"type": "offering", "uuid": offering.hex}]})
    for delivery, count in (("rmq", 1), ("webhook", 0)):
        listed = await client.get(CONSUMERS, params={"delivery": delivery}, headers=SERVICE)
        assert listed.status_code == 200, listed.text
        assert len(listed.json()) == count
        counted = await client.head(CONSUMERS, params={"delivery": delivery}, headers=SERVICE)
        assert counted.headers["X-Result-Count"] == str(count)
    bad = await client.get(CONSUMERS, params={"delivery": "email"}, headers=SERVICE)
    assert bad.status_code == 400
    assert bad.json()["errors"][0]["field"].endswith("delivery")


# No relay and no scheduler: their claims and jobs (the access sweep the users' changes wake
# among them), run beside the request, would be counted with the request's statements.
@pytest.mark.settings(relay_enabled=False, scheduler_enabled=False)
async def test_the_blocked_reason_on_each_row_the_database_tells(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    state: Runtime = app.state.queuekeeper
    owners = []
    for _ in range(5):
        agent, offering = await backend.agent_with_offering()
        made = await register(agent, {"scopes": [{"type": "offering", "uuid": offering.hex}]})
        assert made.status_code == 201, made.text
        owners.append((agent, made.json()))
    inactive, no_token, expired, away, fine = owners
    await backend.put_user(inactive[0].uuid, is_active=False, token=inactive[0].token)
    await backend.put_user(no_token[0].uuid, token=None)
    await backend.expire_token_at(expired[0], utcnow() - timedelta(minutes=1))
    await set_presence(
        state.sessions, away[0].vhost, away[1]["queue_name"], consumers=0, away_for=3600
    )
    await set_presence(
        state.sessions, fine[0].vhost, fine[1]["queue_name"], consumers=0, away_for=5
    )

    with database_statements(state.engine, own_only=True) as statements:
        listed = await client.get(CONSUMERS, headers=SERVICE)
    assert listed.status_code == 200
    reasons = {row["rmq_username"]: row["delivery_blocked_reason"] for row in listed.json()}
    assert reasons == {
        inactive[1]["rmq_username"]: "owner_inactive",
        no_token[1]["rmq_username"]: "no_token",
        expired[1]["rmq_username"]: "token_expired",
        away[1]["rmq_username"]: "agent_away",
        fine[1]["rmq_username"]: None,  # away for less than park_after: not yet parking
    }
    # Batched: the same statements for five rows as for one.
    with database_statements(state.engine, own_only=True) as single:
        await client.get(CONSUMERS, params={"user_uuid": fine[0].uuid.hex}, headers=SERVICE)
    assert single  # the request's own statements were counted
    assert len(statements) == len(single), (statements, single)
    one = await client.get(f"{CONSUMERS}{away[1]['rmq_username']}/", headers=SERVICE)
    assert one.json()["delivery_blocked_reason"] == "agent_away"
