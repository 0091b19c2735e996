"""The OpenAPI document: valid, and complete for every route — also routes added later,
since it walks whatever the app serves."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate

from queuekeeper.app import TAGS, create_app
from queuekeeper.config import Settings

AUDIENCES = {tag["name"] for tag in TAGS}
OPERATION_ID = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
METHODS = {"get", "put", "post", "delete", "patch", "head", "options"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    document: dict[str, Any] = create_app(Settings(service_tokens=["x" * 16])).openapi()
    return document


def operations(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{method.upper()} {path}", operation)
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in METHODS
    ]


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/components/schemas/")
        node = schema["components"]["schemas"][name]
    return node


def has_example(schema: dict[str, Any], media: dict[str, Any]) -> bool:
    if "example" in media or "examples" in media:
        return True
    node = resolve(schema, media.get("schema", {}))
    if node.get("type") == "array":
        node = resolve(schema, node.get("items", {}))
    return bool(node.get("examples") or node.get("example"))


def test_document_is_valid_openapi(schema: dict[str, Any]) -> None:
    validate(schema)
    assert schema["openapi"].startswith("3.")
    assert len(operations(schema)) >= 19


def test_every_operation_is_tagged_described_and_readably_named(schema: dict[str, Any]) -> None:
    problems = []
    seen: dict[str, str] = {}
    for name, operation in operations(schema):
        tags = operation.get("tags", [])
        if len(tags) != 1 or tags[0] not in AUDIENCES:
            problems.append(f"{name}: tags {tags}, expected exactly one of {sorted(AUDIENCES)}")
        for field in ("summary", "description"):
            if not operation.get(field, "").strip():
                problems.append(f"{name}: no {field}")
        operation_id = operation.get("operationId", "")
        if not OPERATION_ID.fullmatch(operation_id):
            problems.append(f"{name}: operationId {operation_id!r} is not snake_case")
        if operation_id in seen:
            problems.append(
                f"{name}: operationId {operation_id!r} also used by {seen[operation_id]}"
            )
        seen[operation_id] = name
    assert problems == []
    assert {"create_queue", "list_subscriptions", "put_user", "readyz"} <= set(seen)


def test_every_error_is_documented_with_its_body(schema: dict[str, Any]) -> None:
    problems = []
    for name, operation in operations(schema):
        responses = operation["responses"]
        if "422" in responses:
            problems.append(f"{name}: documents 422, but validation errors answer 400")
        takes_input = bool(
            operation.get("parameters") or operation.get("requestBody") or operation.get("security")
        )
        errors = {code: response for code, response in responses.items() if code[0] in "45"}
        if takes_input and not any(code.startswith("4") for code in errors):
            problems.append(f"{name}: takes input but documents no 4xx")
        for code, response in errors.items():
            media = response.get("content", {}).get("application/json")
            if media is None:
                problems.append(f"{name} {code}: no JSON body documented")
                continue
            body = resolve(schema, media.get("schema", {}))
            if "detail" not in body.get("properties", {}):
                problems.append(f"{name} {code}: body has no `detail`")
            if not response.get("description", "").strip():
                problems.append(f"{name} {code}: no description")
        if "503" in errors and "Retry-After" not in errors["503"].get("headers", {}):
            problems.append(f"{name} 503: Retry-After not documented")
    assert problems == []


def test_every_body_and_answer_has_an_example(schema: dict[str, Any]) -> None:
    problems = []
    for name, operation in operations(schema):
        body = operation.get("requestBody")
        if body is not None:
            for media_type, media in body.get("content", {}).items():
                if not has_example(schema, media):
                    problems.append(f"{name}: request body ({media_type}) has no example")
        for code, response in operation["responses"].items():
            for media_type, media in response.get("content", {}).items():
                if not has_example(schema, media):
                    problems.append(f"{name} {code}: response ({media_type}) has no example")
    assert problems == []


def test_error_body_schema_is_shared(schema: dict[str, Any]) -> None:
    error = schema["components"]["schemas"]["ErrorBody"]
    assert error["required"] == ["detail"]
    assert "errors" in error["properties"]
    conflict = schema["paths"]["/api/event-subscriptions/{subscription_uuid}/create_queue/"][
        "post"
    ]["responses"]["409"]["content"]["application/json"]["schema"]
    assert resolve(schema, conflict)["properties"].keys() >= {"detail", "queue_name", "action"}


async def test_docs_and_document_are_served(client: httpx.AsyncClient) -> None:
    document = await client.get("/openapi.json")
    assert document.status_code == 200
    assert document.json()["info"]["title"] == "queuekeeper"
    docs = await client.get("/docs")
    assert docs.status_code == 200
    assert "swagger-ui" in docs.text
