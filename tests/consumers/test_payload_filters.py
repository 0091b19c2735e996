"""Payload filters (contract §12) compare JSON values by JSON type: a number never matches
a boolean (`[1]` once matched `true`, `[false]` matched `0`), `null` matches only an
explicit null (it once matched a missing field), and 1 and 1.0 are one JSON number. Every
top-level field of the body a consumer receives may be filtered on, `schema_version` and a
fan-out copy's own `offering_uuid` among them (a filter on `schema_version` never matched)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from queuekeeper.events.recipients import Copy, _consumer
from tests.consumers.scopes import scopes
from tests.consumers.test_fan_out import agent_with_two_offerings, group_event
from tests.consumers.test_scoped_delivery import bodies, consumer_of
from tests.events.support import order_event, post_event
from tests.helpers import Agent, Backend

MISSING = object()
COPY = Copy(None, uuid.uuid4(), "consumer_x", "vhost")


def takes(filters: dict[str, list[Any]], value: Any) -> bool:
    consumer = _consumer(uuid.uuid4(), [[], filters], COPY)
    body = {"object_type": "order"} if value is MISSING else {"object_type": "order", "f": value}
    return consumer.takes("order", body)


@pytest.mark.parametrize(
    ("values", "matching", "not_matching"),
    [
        ([1], [1, 1.0], [True, "1", None, MISSING, [1]]),
        ([1.5], [1.5], [1, True]),
        ([True], [True], [1, 1.0, "true", MISSING]),
        ([False], [False], [0, 0.0, None, "", MISSING]),
        ([0], [0, 0.0], [False, None, MISSING]),
        ([None], [None], [MISSING, False, 0, "", []]),
        (["a"], ["a"], ["A", ["a"], MISSING]),
        ([[1, True]], [[1, True], [1.0, True]], [[True, 1], [1, 1], [True, True]]),
        ([{"a": 1}], [{"a": 1}, {"a": 1.0}], [{"a": True}, {"a": 1, "b": 2}, {}]),
    ],
)
def test_values_match_by_json_type(
    values: list[Any], matching: list[Any], not_matching: list[Any]
) -> None:
    for value in matching:
        assert takes({"f": values}, value), (values, value)
    for value in not_matching:
        assert not takes({"f": values}, value), (values, value)


def test_a_filter_on_the_schema_version_is_decided_once() -> None:
    # Every consumer copy says schema_version 1: no filter left, or one that holds nothing.
    assert _consumer(uuid.uuid4(), [[], {"schema_version": [1, 2]}], COPY).payload_filters == ()
    for values in ([2], [True], ["1"]):
        assert not takes({"schema_version": values}, "anything")


async def _queued(client: httpx.AsyncClient, event: dict[str, Any]) -> int:
    answer = await post_event(client, event, wait=True)
    assert answer.status_code == 200, answer.text
    queued: int = answer.json()["queued"]
    return queued


def _order(offering: uuid.UUID, **fields: Any) -> dict[str, Any]:
    return order_event(offering, payload={"order_uuid": uuid.uuid4().hex, **fields})


async def _filtered(agent: Agent, offering: uuid.UUID, filters: dict[str, Any]) -> str:
    made = await consumer_of(
        agent, {"scopes": scopes(("offering", offering)), "payload_filters": filters}
    )
    assert made["payload_filters"] == filters
    queue: str = made["queue_name"]
    return queue


async def test_events_are_filtered_by_json_type(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    queue = await _filtered(agent, offering, {"n": [1]})
    sent = [_order(offering, n=1), _order(offering, n=True), _order(offering, n=1.0)]
    assert [await _queued(client, event) for event in sent] == [1, 0, 1]
    await _filtered(agent, offering, {"n": [False]})
    sent = [_order(offering, n=0), _order(offering, n=False), _order(offering)]
    assert [await _queued(client, event) for event in sent] == [0, 1, 0]
    await _filtered(agent, offering, {"n": [None]})
    sent = [_order(offering), _order(offering, n=None), _order(offering, n=0)]
    assert [await _queued(client, event) for event in sent] == [0, 1, 0]
    received = [body.get("n", "missing") for body in await bodies(agent, queue)]
    assert json.dumps(received) == json.dumps([1, 1.0, False, None])


async def test_the_bodys_own_top_level_fields_are_filterable(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    # Registered as any other field (a 201 with the filter answered), and matched.
    registered = await agent.client.post(
        "/api/event-consumers/register/",
        json={
            "scopes": scopes(("offering", offering)),
            "payload_filters": {"schema_version": [1], "object_type": ["order"]},
        },
        headers=agent.headers,
    )
    assert registered.status_code == 201, registered.text
    assert registered.json()["payload_filters"] == {
        "schema_version": [1],
        "object_type": ["order"],
    }
    assert await _queued(client, _order(offering)) == 1
    await _filtered(agent, offering, {"schema_version": [2]})
    assert await _queued(client, _order(offering)) == 0


async def test_a_fan_out_copy_is_filtered_on_the_offering_it_carries(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, first, second = await agent_with_two_offerings(backend)
    made = await consumer_of(
        agent,
        {
            "scopes": scopes(("offering", first), ("offering", second)),
            "payload_filters": {"offering_uuid": [second.hex]},
        },
    )
    assert await _queued(client, group_event([first, second])) == 1
    (body,) = await bodies(agent, made["queue_name"])
    assert body["offering_uuid"] == second.hex
