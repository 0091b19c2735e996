"""What a queue consumer can see of its deliveries (contract §14), on the real broker: each
copy as the relay settled it, the filters and pages of the list, and nobody else's; and a
consumer's status telling the truth about access (no `no_access` for a consumer bound
through a role)."""

from __future__ import annotations

import uuid
from datetime import UTC, timedelta
from typing import Any

import httpx
import pytest

from queuekeeper.consumers import repository as consumer_copies
from queuekeeper.models import utcnow
from tests.consumers.scopes import role, scopes, tree, unrole
from tests.consumers.test_event_consumers_api import CONSUMERS, SERVICE, register
from tests.events.support import order_event, post_batch, post_event
from tests.helpers import Agent, Backend


def _path(consumer: str, event_id: str = "") -> str:
    return f"{CONSUMERS}{consumer}/deliveries/" + (f"{event_id}/" if event_id else "")


async def _list(agent: Agent, consumer: str, **params: Any) -> httpx.Response:
    answer = await agent.client.get(_path(consumer), params=params, headers=agent.headers)
    assert answer.status_code == 200, answer.text
    return answer


async def _queue_consumer(backend: Backend) -> tuple[Agent, uuid.UUID, str]:
    agent, offering = await backend.agent_with_offering()
    made = await register(agent, {"scopes": scopes(("offering", offering))})
    assert made.status_code == 201, made.text
    return agent, offering, made.json()["rmq_username"]


async def test_a_queue_consumers_copies_are_listed_as_the_broker_confirmed_them(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering, consumer = await _queue_consumer(backend)
    accepted = await post_event(client, order_event(offering, event_id="queue-1"), wait=True)
    assert accepted.json()["queued"] == 1, accepted.text
    (row,) = (await _list(agent, consumer)).json()
    assert row["event_id"] == "queue-1"
    assert row["object_type"] == "order"
    assert row["state"] == "delivered"
    assert row["last_status"] == "confirmed"
    assert row["delivered_at"] is not None
    assert row["delivered_at"] == row["last_attempt_at"]
    assert row["replay"] is False
    assert row["given_up_reason"] is None
    assert row["next_attempt_at"] is None
    item = (await client.get(_path(consumer, "queue-1"), headers=agent.headers)).json()
    (attempt,) = item["attempt_log"]
    assert attempt["status"] == "confirmed"
    assert attempt["error"] is None
    assert attempt["at"] == row["delivered_at"]
    assert isinstance(attempt["duration_ms"], int)
    # The service token sees it too.
    assert (await client.get(_path(consumer, "queue-1"), headers=SERVICE)).json() == item


async def test_another_users_consumer_is_not_found(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    _agent, offering, consumer = await _queue_consumer(backend)
    await post_event(client, order_event(offering, event_id="mine-1"), wait=True)
    stranger, _ = await backend.agent_with_offering()
    for path in (_path(consumer), _path(consumer, "mine-1"), _path(uuid.uuid4().hex)):
        answer = await client.get(path, headers=stranger.headers)
        assert answer.status_code == 404, answer.text
        assert "mine-1" not in answer.text
    unknown_event = await client.get(_path(consumer, "never-sent"), headers=SERVICE)
    assert unknown_event.status_code == 404


async def test_filters_and_pages_newest_first(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering, consumer = await _queue_consumer(backend)
    before = utcnow()
    events = [order_event(offering, event_id=f"page-{n}") for n in range(5)]
    events.append(
        {
            "offering_uuid": offering.hex,
            "object_type": "resource",
            "event_id": "other-type",
            "payload": {"resource_uuid": uuid.uuid4().hex},
        }
    )
    assert (await post_batch(client, events, wait=True)).status_code in (200, 202)
    after = utcnow()
    first = await _list(agent, consumer, page_size=2)
    assert first.headers["X-Result-Count"] == "6"
    assert 'rel="next"' in first.headers["Link"]
    assert [row["event_id"] for row in first.json()] == ["other-type", "page-4"]
    last = await _list(agent, consumer, page_size=2, page=3)
    assert [row["event_id"] for row in last.json()] == ["page-1", "page-0"]
    # Past the end: no row, and still how many match.
    beyond = await _list(agent, consumer, page_size=2, page=4)
    assert (beyond.json(), beyond.headers["X-Result-Count"]) == ([], "6")
    orders = await _list(agent, consumer, object_type="order")
    assert orders.headers["X-Result-Count"] == "5"
    assert [row["event_id"] for row in orders.json()] == [f"page-{n}" for n in range(4, -1, -1)]
    assert [r["event_id"] for r in (await _list(agent, consumer, event_id="page-2")).json()] == [
        "page-2"
    ]
    assert len((await _list(agent, consumer, state="delivered")).json()) == 6
    assert (await _list(agent, consumer, state="parked")).json() == []
    window = {"accepted_after": before.isoformat(), "accepted_before": after.isoformat()}
    assert (await _list(agent, consumer, **window)).headers["X-Result-Count"] == "6"
    later = (after + timedelta(seconds=1)).astimezone(UTC).replace(tzinfo=None).isoformat()
    assert (await _list(agent, consumer, accepted_after=later)).json() == []  # naive: UTC
    assert "X-Result-Count-Capped" not in first.headers
    refused = await client.get(_path(consumer), params={"state": "lost"}, headers=agent.headers)
    assert refused.status_code == 400
    assert "state" in refused.text
    # A time outside years 1-9999 in UTC is a 400 naming it (it answered 500 once).
    early = {"accepted_after": "0001-01-01T00:00:00+14:00"}
    refused = await client.get(_path(consumer), params=early, headers=agent.headers)
    assert refused.status_code == 400, refused.text
    assert "accepted_after" in refused.text


async def test_a_consumer_bound_through_a_role_is_not_said_to_have_no_access(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Its owner holds no offering grant: access comes from a project role, as the rule that
    publishes its copies allows. `/status/` and the consumer's own answer agree."""
    agent = await backend.put_user()
    entities = await tree(client)
    granted = await role(client, agent, "project", entities.project)
    made = await register(agent, {"scopes": scopes(("project", entities.project))})
    assert made.status_code == 201, made.text
    consumer = made.json()["rmq_username"]
    got = (await client.get(f"{CONSUMERS}{consumer}/", headers=agent.headers)).json()
    status = (await client.get(f"{CONSUMERS}{consumer}/status/", headers=agent.headers)).json()
    assert got["delivery_blocked_reason"] is None
    assert status["delivery_blocked_reason"] is None, status["delivery_blocked_detail"]
    # Without the role it may receive nothing through its one binding: both say so.
    await unrole(client, granted)
    got = (await client.get(f"{CONSUMERS}{consumer}/", headers=agent.headers)).json()
    status = (await client.get(f"{CONSUMERS}{consumer}/status/", headers=agent.headers)).json()
    assert got["delivery_blocked_reason"] == "no_access"
    assert status["delivery_blocked_reason"] == "no_access"
    assert "bindings" in status["delivery_blocked_detail"]


async def test_a_long_list_is_counted_to_a_bound_and_every_page_is_still_reached(
    backend: Backend, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumer_copies, "COUNT_LIMIT", 3)
    agent, offering, consumer = await _queue_consumer(backend)
    events = [order_event(offering, event_id=f"long-{n}") for n in range(5)]
    assert (await post_batch(client, events, wait=True)).status_code in (200, 202)
    seen: list[str] = []
    page: dict[str, Any] = {"page_size": 2}
    for number in (1, 2, 3):
        answer = await _list(agent, consumer, **page, page=number)
        assert answer.headers["X-Result-Count"] == "3"
        assert answer.headers["X-Result-Count-Capped"] == "true"
        seen += [row["event_id"] for row in answer.json()]
        assert ('rel="next"' in answer.headers.get("Link", "")) == (number < 3)
    assert seen == [f"long-{n}" for n in range(4, -1, -1)]
    few = await _list(agent, consumer, event_id="long-1")
    assert few.headers["X-Result-Count"] == "1"
    assert "X-Result-Count-Capped" not in few.headers
