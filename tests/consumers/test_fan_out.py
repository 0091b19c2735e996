"""An event sent to several offerings (`offering_uuids`, contract §10): one event_id, one copy
per queue, each copy's body and headers carrying the offering of the queue it went to."""

from __future__ import annotations

import json
import uuid

import httpx

from tests.consumers.test_delivery import consumer_for
from tests.events.support import drain, event_detail, post_batch, post_event, register
from tests.events.test_accept import MINIMAL_PAYLOADS
from tests.helpers import Agent, Backend


async def agent_with_two_offerings(backend: Backend) -> tuple[Agent, uuid.UUID, uuid.UUID]:
    agent, first = await backend.agent_with_offering()
    second = await backend.put_offering()
    await backend.grant(agent, second)
    return agent, first, second


def group_event(offerings: list[uuid.UUID], **extra: object) -> dict[str, object]:
    return {
        "offering_uuids": [o.hex for o in offerings],
        "object_type": "service_provider_project_group",
        "payload": MINIMAL_PAYLOADS["service_provider_project_group"],
        **extra,
    }


async def test_one_event_reaches_each_offerings_queue_with_its_own_offering(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, first, second = await agent_with_two_offerings(backend)
    unrelated = await backend.put_offering()  # named in the event, nobody listens there
    first_queue = await consumer_for(agent, first, ["service_provider_project_group"])
    second_queue = await consumer_for(agent, second, [])  # every type
    legacy = await register(backend, offering=second, object_type="service_provider_project_group")

    answer = await post_event(
        client, group_event([first, second, unrelated], event_id="pg-1"), wait=True
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["event_id"] == "pg-1"
    assert answer.json()["queued"] == 3
    assert {d["state"] for d in answer.json()["deliveries"]} == {"published"}

    for queue, offering in ((first_queue, first), (second_queue, second)):
        (message,) = await drain(agent.vhost, queue)
        body = json.loads(message.body)
        assert body["offering_uuid"] == offering.hex
        assert (body["object_type"], body["schema_version"], body["gid"]) == (
            "service_provider_project_group",
            1,
            20001,
        )
        assert message.message_id == "pg-1"
        assert message.headers["offering_uuid"] == offering.hex
    (message,) = await drain(legacy.vhost, legacy.queue_name)
    assert json.loads(message.body)["offering_uuid"] == second.hex
    assert "schema_version" not in json.loads(message.body)

    detail = await event_detail(client, "pg-1")
    assert detail["offering_uuid"] == first.hex
    assert detail["offering_uuids"] == [first.hex, second.hex, unrelated.hex]
    again = await post_event(client, group_event([first, second, unrelated], event_id="pg-1"))
    assert (again.status_code, again.json()["duplicate"]) == (200, True)


async def test_a_consumer_scoped_to_several_of_the_offerings_gets_one_copy(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, first, second = await agent_with_two_offerings(backend)
    registered = await agent.client.post(
        "/api/event-consumers/register/",
        json={"scopes": [{"type": "offering", "uuid": o.hex} for o in (first, second)]},
        headers=agent.headers,
    )
    assert registered.status_code == 201, registered.text
    queue = registered.json()["queue_name"]
    answer = await post_event(client, group_event([second, first]), wait=True)
    assert answer.json()["queued"] == 1
    (message,) = await drain(agent.vhost, queue)
    assert json.loads(message.body)["offering_uuid"] == second.hex  # the first named


async def test_bad_offering_fields_are_refused_naming_the_field(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    first = await backend.put_offering()
    second = await backend.put_offering()
    cases = [
        ({**group_event([first]), "offering_uuid": first.hex}, "offering_uuid", "exactly one"),
        (
            {k: v for k, v in group_event([first]).items() if k != "offering_uuids"},
            "offering_uuid",
            "exactly one",
        ),
        (group_event([first, first]), "offering_uuids", "listed twice"),
        (group_event([first, uuid.uuid4()]), "offering_uuids.1", "Unknown offering"),
        ({**group_event([first]), "offering_uuids": []}, "offering_uuids", ""),
    ]
    for event, field, words in cases:
        response = await post_event(client, event)
        assert response.status_code == 400, (event, response.text)
        body = response.json()
        assert body["errors"][0]["field"] == field, body
        assert words in body["detail"], body
    payload = {**group_event([first, second])}
    payload["payload"] = {**payload["payload"], "offering_uuid": uuid.uuid4().hex}  # type: ignore[dict-item]
    response = await post_event(client, payload)
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "payload.offering_uuid"
    # In a batch the field is named with its position.
    batch = await post_batch(client, [group_event([first]), group_event([second, uuid.uuid4()])])
    assert batch.status_code == 400
    assert batch.json()["errors"][0]["field"] == "events.1.offering_uuids.1"
