"""The events routes are documented: tags, summary, description, errors, body examples; each
object type's payload schema and the running limits; bodies that are not JSON objects."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from queuekeeper.config import Settings
from queuekeeper.events.payloads import OBJECT_TYPES
from tests.helpers import Backend


async def test_event_routes_are_documented(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    routes = {
        ("post", "/api/internal/events/"),
        ("post", "/api/internal/events/batch/"),
        ("get", "/api/internal/events/{event_id}/"),
        ("get", "/api/admin/outbox/"),
    }
    for method, path in routes:
        operation = document["paths"][path][method]
        assert operation["tags"], path
        assert operation["summary"], path
        assert operation["description"], path
        assert {"401", "403"} <= set(operation["responses"]), path
        body = operation.get("requestBody")
        if body is not None:
            ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
            assert schemas[ref].get("examples"), ref
    accepted = document["paths"]["/api/internal/events/"]["post"]
    assert {"200", "202", "400", "503"} <= set(accepted["responses"])
    parameters = {p["name"] for p in accepted["parameters"]}
    assert "wait" in parameters


def _resolve(schemas: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schemas[node["$ref"].rsplit("/", 1)[-1]]
    return node


async def test_each_object_type_and_its_payload_rules_are_in_the_document(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """What /openapi.json says a payload needs is what the accept path refuses without."""
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    event = schemas["EventIn"]
    assert event["discriminator"]["propertyName"] == "object_type"
    mapping = event["discriminator"]["mapping"]
    assert sorted(mapping) == sorted(OBJECT_TYPES)
    offering = await backend.put_offering()
    for object_type, ref in mapping.items():
        variant = _resolve(schemas, {"$ref": ref})
        assert variant["properties"]["object_type"]["enum"] == [object_type]
        payload = _resolve(schemas, variant["properties"]["payload"])
        required = set(payload.get("required", []))
        response = await client.post(
            "/api/internal/events/",
            json={"offering_uuid": offering.hex, "object_type": object_type, "payload": {}},
            headers=backend.headers,
        )
        if required:
            assert response.status_code == 400, (object_type, response.text)
            fields = {error["field"] for error in response.json()["errors"]}
            assert fields == {f"payload.{name}" for name in required}, object_type
        else:
            assert response.status_code in (200, 202), (object_type, response.text)
    batch = schemas["EventBatchIn"]["properties"]["events"]
    assert batch["items"] == {"$ref": "#/components/schemas/EventIn"}


@pytest.mark.settings(text_max_length=40, events_batch_max=3)
async def test_documented_limits_are_the_running_ones(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    documented = schemas["SubscriptionCreate"]["properties"]["description"]["maxLength"]
    assert documented == settings.text_max_length == 40
    assert schemas["RegisterEventSubscription"]["properties"]["description"]["maxLength"] == 40
    assert schemas["EventBatchIn"]["properties"]["events"]["maxItems"] == 3
    agent = await backend.put_user()
    for length, status in ((documented, 201), (documented + 1, 400)):
        response = await client.post(
            "/api/event-subscriptions/", json={"description": "x" * length}, headers=agent.headers
        )
        assert response.status_code == status, (length, response.text)


@pytest.mark.parametrize(
    ("content", "content_type", "expected"),
    [
        (
            "a=b",
            "application/x-www-form-urlencoded",
            "The body is application/x-www-form-urlencoded",
        ),
        ("hello", "text/plain", "The body is text/plain"),
        ('{"offering_uuid": ', "application/json", "The body is not valid JSON"),
        ("[1, 2]", "application/json", "The body must be a JSON object"),
    ],
)
async def test_a_body_that_is_not_a_json_object_says_to_send_json(
    client: httpx.AsyncClient, backend: Backend, content: str, content_type: str, expected: str
) -> None:
    for path in ("/api/internal/events/", f"/api/internal/offerings/{uuid.uuid4()}/"):
        method = "POST" if path.endswith("events/") else "PUT"
        response = await client.request(
            method,
            path,
            content=content,
            headers={**backend.headers, "Content-Type": content_type},
        )
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["detail"].startswith(expected), body
        assert body["detail"].endswith("send JSON with Content-Type: application/json."), body
        assert [error["field"] for error in body["errors"]] == ["body"], body
