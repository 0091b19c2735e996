"""POST /api/internal/events/ and /batch/: validation, duplicates, recipients, the outbox rows."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from structlog.testing import capture_logs

from queuekeeper.events.payloads import PAYLOAD_MODELS
from tests.events.support import (
    SERVICE,
    event_detail,
    order_event,
    post_batch,
    post_event,
    register,
)
from tests.helpers import Backend, database_statements

pytestmark = pytest.mark.settings(relay_enabled=False, presence_events_enabled=False)

U = "6f1c2a3b4d5e4f60a1b2c3d4e5f60718"
MINIMAL_PAYLOADS: dict[str, dict[str, Any]] = {
    "order": {"order_uuid": U},
    "user_role": {"project_uuid": U, "project_name": "P"},
    "resource": {"resource_uuid": U},
    "resource_periodic_limits": {
        "resource_uuid": U,
        "backend_id": "acc-1",
        "action": "apply_periodic_settings",
        "settings": {"limit": 1},
    },
    "offering_user": {"offering_user_uuid": U, "action": "username_set"},
    "service_account": {
        "account_uuid": U,
        "account_username": "svc",
        "project_uuid": U,
        "action": "create",
    },
    "course_account": {
        "account_uuid": U,
        "account_username": "c",
        "project_uuid": U,
        "action": "delete",
    },
    "importable_resources": {"backend_resource_request_uuid": U},
    "resource_api_key_rotation": {
        "action": "rotate",
        "resource_uuid": U,
        "api_key_uuid": U,
        "resource_backend_id": "slurm-acc-1",
        "client_id": "client-1",
    },
    "offering_resources_sync": {},
    "service_provider_project_group": {
        "action": "create",
        "service_provider_uuid": U,
        "customer_uuid": U,
        "project_group_uuid": U,
        "name": "pg_1",
        "gid": 20001,
    },
    "call": {},
    "proposal": {},
    "resource_end_date_change_request": {},
    "service_provider_account": {},
    "user_lifecycle": {},
    "user_profile": {},
    "user_ssh_key": {},
}
# In client 8.1.3's enum, with no required field (no published agent handles them yet).
FREE_FORM = {
    "offering_resources_sync",
    "call",
    "proposal",
    "resource_end_date_change_request",
    "service_provider_account",
    "user_lifecycle",
    "user_profile",
    "user_ssh_key",
}
# One required field per type, and what leaving it out (or spoiling it) must be reported as.
SPOILED: dict[str, tuple[dict[str, Any], str]] = {
    "order": ({}, "payload.order_uuid"),
    "user_role": ({"project_uuid": U, "project_name": "P", "user_uuid": U}, "payload"),
    "resource": ({"resource_uuid": "not-a-uuid"}, "payload.resource_uuid"),
    "resource_periodic_limits": (
        {**MINIMAL_PAYLOADS["resource_periodic_limits"], "action": "other"},
        "payload.action",
    ),
    "offering_user": ({"offering_user_uuid": U, "action": "explode"}, "payload.action"),
    "service_account": (
        {k: v for k, v in MINIMAL_PAYLOADS["service_account"].items() if k != "project_uuid"},
        "payload.project_uuid",
    ),
    "course_account": (
        {**MINIMAL_PAYLOADS["course_account"], "action": "update"},
        "payload.action",
    ),
    "importable_resources": ({}, "payload.backend_resource_request_uuid"),
    "resource_api_key_rotation": (
        {"action": "rotate", "resource_uuid": U, "api_key_uuid": U, "resource_backend_id": "b"},
        "payload",
    ),
    "service_provider_project_group": (
        {**MINIMAL_PAYLOADS["service_provider_project_group"], "customer_uuid": "x"},
        "payload.customer_uuid",
    ),
}


def test_every_object_type_has_a_case() -> None:
    assert set(MINIMAL_PAYLOADS) == set(PAYLOAD_MODELS)
    assert set(SPOILED) == set(PAYLOAD_MODELS) - FREE_FORM


async def test_event_is_accepted_once_and_a_repeat_answers_the_first_counts(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    event = order_event(registered.offering, event_id="evt-1")

    first = await post_event(client, event)
    assert first.status_code == 202, first.text
    assert first.json() == {
        "event_id": "evt-1",
        "queued": 1,
        "skipped_unregistered": 0,
        "duplicate": False,
    }
    # A second queue registered afterwards must not change what the repeat answers or sends.
    await register(backend, offering=registered.offering)
    again = await post_event(client, {**event, "payload": {"order_uuid": U}})
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "duplicate": True}

    detail = await event_detail(client, "evt-1")
    assert len(detail["deliveries"]) == 1
    assert detail["deliveries"][0]["queue_name"] == registered.queue_name
    assert detail["deliveries"][0]["state"] == "pending"
    assert detail["body"]["order_uuid"] == event["payload"]["order_uuid"]


async def test_batch_answers_in_order_and_counts_a_repeat_within_it_once(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    events = [
        order_event(registered.offering, event_id="b-1"),
        order_event(registered.offering, event_id="b-2"),
        order_event(registered.offering, event_id="b-1"),
        order_event(registered.offering),  # no id: one is made up
    ]
    response = await post_batch(client, events)
    assert response.status_code == 202, response.text
    answers = response.json()["events"]
    assert [a["event_id"] for a in answers[:3]] == ["b-1", "b-2", "b-1"]
    assert [a["duplicate"] for a in answers] == [False, False, True, False]
    assert all(a["queued"] == 1 for a in answers)
    made_up = answers[3]["event_id"]
    assert uuid.UUID(made_up).hex == made_up
    assert len((await event_detail(client, "b-1"))["deliveries"]) == 1
    assert len((await event_detail(client, made_up))["deliveries"]) == 1


async def test_a_bad_event_names_its_index_and_field_and_nothing_of_the_batch_is_stored(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    events = [
        order_event(offering, event_id="ok-1"),
        {**order_event(offering, event_id="bad-2"), "payload": {"order_state": "done"}},
        order_event(offering, event_id="ok-3"),
    ]
    response = await post_batch(client, events)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["errors"] == [{"field": "events.1.payload.order_uuid", "message": "Field required"}]
    assert "events.1.payload.order_uuid" in body["detail"]
    for event_id in ("ok-1", "bad-2", "ok-3"):
        missing = await client.get(f"/api/internal/events/{event_id}/", headers=SERVICE)
        assert missing.status_code == 404

    # Envelope errors are named the same way (FastAPI's validation), unknown types included.
    response = await post_batch(client, [events[0], {**events[2], "object_type": "invoice"}])
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "events.1.object_type"
    assert "unknown object type 'invoice'" in response.json()["errors"][0]["message"]


async def test_unknown_offering_is_a_400_naming_the_event(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    stranger = uuid.uuid4()
    response = await post_batch(client, [order_event(offering), order_event(stranger)])
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {
            "field": "events.1.offering_uuid",
            "message": f"Unknown offering {stranger.hex}: the backend has not pushed it.",
        }
    ]
    single = await post_event(client, order_event(stranger, event_id="lost"))
    assert single.status_code == 400
    assert single.json()["errors"][0]["field"] == "offering_uuid"
    assert (await client.get("/api/internal/events/lost/", headers=SERVICE)).status_code == 404


async def test_payload_contradicting_the_envelope_is_a_400(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    other = uuid.uuid4().hex
    event = order_event(offering)
    event["payload"].update(offering_uuid=other, object_type="resource")
    response = await post_event(client, event)
    assert response.status_code == 400
    fields = [error["field"] for error in response.json()["errors"]]
    assert fields == ["payload.offering_uuid", "payload.object_type"]

    # The same values (dashed form included) are fine; the envelope's are sent.
    event["payload"].update(offering_uuid=str(offering), object_type="order", extra={"a": 1})
    response = await post_event(client, {**event, "event_id": "same"})
    assert response.status_code == 202, response.text
    body = (await event_detail(client, "same"))["body"]
    assert body["offering_uuid"] == offering.hex
    assert body["extra"] == {"a": 1}


@pytest.mark.parametrize("object_type", sorted(PAYLOAD_MODELS))
async def test_each_object_type_is_checked_against_its_payload_model(
    client: httpx.AsyncClient, backend: Backend, object_type: str
) -> None:
    offering = await backend.put_offering()
    good = {
        "offering_uuid": offering.hex,
        "object_type": object_type,
        "payload": {**MINIMAL_PAYLOADS[object_type], "kept": "extra field"},
    }
    response = await post_event(client, good)
    assert response.status_code == 202, response.text
    body = (await event_detail(client, response.json()["event_id"]))["body"]
    assert body["kept"] == "extra field"
    if object_type in SPOILED:
        payload, field = SPOILED[object_type]
        response = await post_event(client, {**good, "payload": payload})
        assert response.status_code == 400, response.text
        assert response.json()["errors"][0]["field"] == field


@pytest.mark.settings(relay_enabled=False, events_batch_max=3)
async def test_a_batch_over_the_limit_is_a_400_naming_the_limit(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    response = await post_batch(client, [order_event(offering) for _ in range(4)])
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "events"
    assert "at most 3 events" in response.json()["detail"]
    assert (await post_batch(client, [order_event(offering) for _ in range(3)])).status_code == 202


async def test_events_need_a_service_token(client: httpx.AsyncClient, backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    body = order_event(offering)
    assert (await client.post("/api/internal/events/", json=body)).status_code == 401
    response = await client.post("/api/internal/events/", json=body, headers=agent.headers)
    assert response.status_code == 403
    response = await client.post(
        "/api/internal/events/batch/", json={"events": [body]}, headers=agent.headers
    )
    assert response.status_code == 403
    assert (await client.get("/api/internal/events/x/", headers=agent.headers)).status_code == 403


async def test_recipients_and_unregistered_subscribers(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """Who gets a copy: registered queues of owners with access, narrowed by user_uuids."""
    mine = await register(backend)
    offering = mine.offering
    theirs = await register(backend, offering=offering)
    # Their queue for another type, on a subscription listing only that type.
    resources = await theirs.agent.create_subscription(
        observable_objects=[{"object_type": "resource"}]
    )
    await register(
        backend,
        agent=theirs.agent,
        offering=offering,
        object_type="resource",
        subscription=resources["uuid"],
    )
    await register(backend, object_type="order")  # another offering
    inactive = await register(backend, offering=offering)
    await backend.put_user(inactive.agent.uuid, is_active=False, token=inactive.agent.token)
    # Subscribed to orders (or to everything), but no queue registered: skipped and counted.
    lister = await backend.put_user()
    await backend.grant(lister, offering)
    listing = await lister.create_subscription(observable_objects=[{"object_type": "order"}])
    everything = await lister.create_subscription()
    # Subscribed to another type only: not counted.
    await lister.create_subscription(observable_objects=[{"object_type": "resource"}])
    # Not granted access: neither a recipient nor counted.
    outsider = await backend.put_user()
    await outsider.create_subscription()

    with capture_logs() as logs:
        response = await post_event(client, order_event(offering, event_id="fan"))
    assert response.json() == {
        "event_id": "fan",
        "queued": 2,
        "skipped_unregistered": 2,
        "duplicate": False,
    }
    detail = await event_detail(client, "fan")
    assert sorted(d["queue_name"] for d in detail["deliveries"]) == sorted(
        [mine.queue_name, theirs.queue_name]
    )
    skipping = [entry for entry in logs if "queue not registered" in entry["event"]]
    assert len(skipping) == 1
    assert sorted(skipping[0]["subscriptions"]) == sorted([listing["uuid"], everything["uuid"]])

    # user_uuids narrows both the recipients and the count of skipped subscriptions.
    narrowed = order_event(offering, event_id="narrow", user_uuids=[str(theirs.agent.uuid)])
    response = await post_event(client, narrowed)
    assert (response.json()["queued"], response.json()["skipped_unregistered"]) == (1, 0)
    detail = await event_detail(client, "narrow")
    assert [d["queue_name"] for d in detail["deliveries"]] == [theirs.queue_name]

    response = await post_event(
        client, order_event(offering, event_id="nobody", user_uuids=[lister.uuid.hex])
    )
    assert (response.json()["queued"], response.json()["skipped_unregistered"]) == (0, 2)


async def test_recipient_lookup_costs_the_same_queries_for_any_fan_out(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    small = await register(backend)
    large = await register(backend)
    for _ in range(6):  # six more users, each with two subscriptions with queues
        agent = await backend.put_user()
        for object_type in ("order", "resource"):
            await register(backend, agent=agent, offering=large.offering, object_type=object_type)
    lister = await backend.put_user()
    await backend.grant(lister, large.offering)
    for _ in range(4):
        await lister.create_subscription()

    def batch(offering: uuid.UUID) -> list[dict[str, Any]]:
        events = [order_event(offering) for _ in range(20)]
        events += [
            {
                "offering_uuid": offering.hex,
                "object_type": "resource",
                "payload": {"resource_uuid": U},
            }
            for _ in range(5)
        ]
        return events

    with database_statements(app.state.queuekeeper.engine, own_only=True) as statements:
        statements.clear()
        response = await post_batch(client, batch(small.offering))
        assert response.status_code == 202
        few = len(statements)
        statements.clear()
        mixed = batch(large.offering) + batch(small.offering)
        response = await post_batch(client, mixed)
        assert response.status_code == 202
        many = len(statements)
    answers = response.json()["events"]
    assert [a["queued"] for a in answers[:21]] == [7] * 20 + [6]
    # The four subscriptions of `lister`, and each user's resource subscription (it lists
    # every type, having no observable_objects) but no order queue on that subscription.
    assert answers[0]["skipped_unregistered"] == 4 + 6
    # The recipients, then the write: one statement.
    assert many == few == 2, [s[:120] for s in statements]


async def test_an_event_that_made_no_copy_says_why(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """`no_copy_reason` comes with `queued: 0` only, and tells the backend what to fix."""

    async def answer(event: dict[str, Any]) -> dict[str, Any]:
        response = await post_event(client, event)
        assert response.status_code in (200, 202), response.text
        body: dict[str, Any] = response.json()
        return body

    # An offering pushed, but no agent of a user with access has set up for it.
    lonely = await backend.put_offering()
    nobody = await answer(order_event(lonely, event_id="to-nobody"))
    assert (nobody["queued"], nobody["no_copy_reason"]) == (0, "no_agent")
    # A subscription of a user without access does not count.
    outsider = await backend.put_user()
    await outsider.create_subscription()
    assert (await answer(order_event(lonely)))["no_copy_reason"] == "no_agent"

    # Subscribed to orders, but no queue registered for them.
    lister = await backend.put_user()
    await backend.grant(lister, lonely)
    await lister.create_subscription(observable_objects=[{"object_type": "order"}])
    unregistered = await answer(order_event(lonely))
    assert (unregistered["queued"], unregistered["skipped_unregistered"]) == (0, 1)
    assert unregistered["no_copy_reason"] == "no_registered_queue"

    # Agents set up for the offering, but not for this type, or not the users named.
    orders_only = await backend.put_user()
    subscription = await orders_only.create_subscription(
        observable_objects=[{"object_type": "order"}]
    )
    registered = await register(backend, agent=orders_only, subscription=subscription["uuid"])
    other_type = {
        "offering_uuid": registered.offering.hex,
        "object_type": "resource",
        "payload": {"resource_uuid": U},
    }
    filtered = await answer(other_type)
    assert (filtered["queued"], filtered["no_copy_reason"]) == (0, "all_recipients_filtered")
    narrowed = await answer(order_event(registered.offering, user_uuids=[outsider.uuid.hex]))
    assert (narrowed["queued"], narrowed["no_copy_reason"]) == (0, "all_recipients_filtered")

    # A copy made: no reason in the answer.
    delivered = await answer(order_event(registered.offering))
    assert delivered["queued"] == 1
    assert "no_copy_reason" not in delivered
    # A repeat of an event that made no copy sends nothing now either, even to an agent
    # that has set up since: it says so.
    await register(backend, offering=lonely)
    again = await answer(order_event(lonely, event_id="to-nobody"))
    assert (again["duplicate"], again["queued"], again["no_copy_reason"]) == (True, 0, "duplicate")

    # In a batch and across offerings (offering_uuids) alike.
    batch = await post_batch(
        client,
        [
            order_event(await backend.put_offering()),
            {**other_type, "offering_uuid": None, "offering_uuids": [registered.offering.hex]},
        ],
    )
    assert batch.status_code == 202, batch.text
    reasons = [event.get("no_copy_reason") for event in batch.json()["events"]]
    assert reasons == ["no_agent", "all_recipients_filtered"]
