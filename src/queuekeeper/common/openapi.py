"""What the OpenAPI document says about errors, and the operation ids generated clients use.

Every error body has the same shape (`ErrorBody`), so a client needs one error type.
FastAPI documents a 422 for every route with parameters; queuekeeper answers
validation errors with a 400 (as Waldur does), so the document is corrected to say so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import BaseRoute

from queuekeeper.common.access import Caller, declared_routes
from queuekeeper.config import Settings

# A field whose limit is a setting carries `json_schema_extra={LIMITED_BY: "<setting>"}` (and a
# static bound, the most any setting may be); the document states the running value instead.
LIMITED_BY = "x-limited-by"


def limited_by(setting: str) -> dict[str, Any]:
    """`json_schema_extra` of a field whose documented limit is the setting `setting`."""
    return {LIMITED_BY: setting}


class FieldError(BaseModel):
    field: str = Field(description="The offending field, dotted for nested ones.")
    message: str = Field(description="What is wrong with it.")


class ErrorBody(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "detail": "object_type: Input should be 'order', 'user_role' or 'resource'",
                    "errors": [
                        {
                            "field": "object_type",
                            "message": "Input should be 'order', 'user_role' or 'resource'",
                        }
                    ],
                }
            ]
        }
    )

    detail: str = Field(description="What was wrong, in words a person can act on.")
    errors: list[FieldError] | None = Field(
        default=None, description="One entry per offending field (bad requests only)."
    )


class QueueConflictBody(ErrorBody):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "detail": "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue "
                    "'subscription_…_order' in vhost '…': received '10000' but current is none",
                    "queue_name": "subscription_0d5e…_offering_5f0c…_order",
                    "vhost": "8b1a9953c4611296a827abf8c47804d7",
                    "action": "Drain the queue (or stop its consumers), delete it, then call "
                    "create_queue again.",
                }
            ]
        }
    )

    queue_name: str
    vhost: str
    action: str = Field(description="What the operator should do.")


_DEFAULTS: dict[int, tuple[str, str]] = {
    400: ("Bad request: the field at fault is named.", "offering_uuid: Unknown offering."),
    401: ("No token, or an unknown, inactive or expired one.", "Invalid token."),
    403: ("The token is valid but not allowed to do this.", "You have no access to offering …"),
    404: ("Not found (or not yours).", "Event subscription '…' not found."),
    409: ("Conflicts with what exists.", "The resource conflicts with an existing one."),
    413: (
        "The body is over this route's limit (the setting is named); refused before it is read.",
        "The request body (70000 bytes) is over this route's limit of 65536 bytes (setting "
        "body_max_bytes).",
    ),
    429: (
        "Too many registration calls with this token; retry after `Retry-After` seconds.",
        "Too many registration calls with this token: at most 20 per 1 second (setting "
        "QUEUEKEEPER_REGISTRATION_RATE_LIMIT='20/second;600/minute'); retry after 1 s.",
    ),
    503: (
        "A dependency (RabbitMQ, its Management API or the database) is unavailable; nothing "
        "was changed. Retry after `Retry-After` seconds.",
        "RabbitMQ is unavailable, nothing was changed; retry later.",
    ),
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {
        "WWW-Authenticate": {
            "description": "The scheme to authenticate with.",
            "schema": {"type": "string"},
        }
    },
    503: {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "integer"},
        }
    },
}
_HEADERS[429] = _HEADERS[503]


def _document_guard(schema: dict[str, Any], routes: list[BaseRoute]) -> None:
    """Every route that takes a body may answer 413 (auth/guard.py); every agent write (a
    registration call) also 429 (rate limit) and 409 (a quota reached). Agent routes are
    those their router declares so (`common/access.py`)."""
    agent_writes = {
        (found.path_format, method.lower())
        for found in declared_routes(routes)
        if found.caller is Caller.AGENT
        for method in found.methods
        if method in ("POST", "PUT")
    }
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            codes = [413] if "requestBody" in operation else []
            if (path, method) in agent_writes:
                codes += [409, 413, 429]
            for code, entry in error_responses(*codes).items():
                entry.pop("model")
                entry["content"] = {
                    "application/json": {
                        "schema": {"$ref": "#/components/schemas/ErrorBody"},
                        **entry.get("content", {}).get("application/json", {}),
                    }
                }
                operation["responses"].setdefault(str(code), entry)


def error_responses(
    *codes: int,
    descriptions: Mapping[int, str] | None = None,
    models: Mapping[int, type[BaseModel]] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for error codes, each with the ErrorBody schema and an example."""
    descriptions = descriptions or {}
    models = models or {}
    responses: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        default_description, example_detail = _DEFAULTS.get(code, ("Error.", "Error."))
        description = descriptions.get(code, default_description)
        entry: dict[str, Any] = {
            "model": models.get(code, ErrorBody),
            "description": description,
        }
        if code not in models:
            entry["content"] = {"application/json": {"example": {"detail": example_detail}}}
        if code in _HEADERS:
            entry["headers"] = _HEADERS[code]
        responses[code] = entry
    return responses


def operation_id(route: APIRoute) -> str:
    """The endpoint function's name: `create_queue`, `list_subscriptions`, …

    Generated clients turn these into method names; FastAPI's default
    (`create_queue_api_event_subscriptions__subscription_uuid__create_queue__post`) reads badly.
    """
    return route.name


_VALIDATION_400 = {
    "description": "Bad request: a parameter or the body failed validation; `errors` names "
    "each field.",
    "content": {
        "application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorBody"},
            "example": ErrorBody.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
        }
    },
}


def _can_fail_validation(operation: dict[str, Any]) -> bool:
    """A body, a query or header parameter, or a typed path parameter can be malformed;
    a plain string path parameter cannot (the endpoint answers 404 for those itself)."""
    if "requestBody" in operation:
        return True
    for parameter in operation.get("parameters", []):
        if parameter.get("in") != "path":
            return True
        if parameter.get("schema", {}).get("type") != "string" or "format" in parameter.get(
            "schema", {}
        ):
            return True
    return False


def _fix_validation_responses(schema: dict[str, Any]) -> None:
    """Replace FastAPI's 422 by the 400 that the validation handler really answers."""
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            if (
                responses.pop("422", None) is not None
                and "400" not in responses
                and _can_fail_validation(operation)
            ):
                responses["400"] = _VALIDATION_400
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if "ErrorBody" not in components:
        error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error_schema.pop("$defs", {}))
        components["ErrorBody"] = error_schema


def _running_limits(schema: dict[str, Any], settings: Settings) -> None:
    """`maxLength`/`maxItems` of settings-bound fields are what this process enforces."""

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            setting = node.pop(LIMITED_BY, None)
            if isinstance(setting, str):
                value = int(getattr(settings, setting))
                key = "maxItems" if node.get("type") == "array" else "maxLength"
                node[key] = min(value, node.get(key, value))
                note = f" At most {node[key]} (setting QUEUEKEEPER_{setting.upper()})."
                node["description"] = (node.get("description", "") + note).strip()
            for child in node.values():
                visit(child)
        elif isinstance(node, list):
            for child in node:
                visit(child)

    visit(schema.get("components", {}))


def install_openapi(
    app: FastAPI,
    settings: Settings,
    extend: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """`extend` adds what a domain knows about its own schemas (events: one schema per
    object type's payload)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
                servers=app.servers,
            )
            _fix_validation_responses(schema)
            _document_guard(schema, app.routes)
            if extend is not None:
                extend(schema)
            _running_limits(schema, settings)
            app.openapi_schema = schema
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # noqa: B010  (the documented way to customise it)
