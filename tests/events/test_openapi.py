"""The events routes are documented: tags, summary, description, errors, body examples."""

from __future__ import annotations

import httpx


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
