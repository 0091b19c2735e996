"""Input no database can take, refused before any endpoint runs: a 400 naming the field.

PostgreSQL refuses a NUL character in text and `NaN`/`Infinity` in JSON; Python's JSON
parser accepts both (`"\\u0000"`, and the non-standard `NaN`, `Infinity`, `-Infinity`), so
without this check they reached the database and failed there. One application-wide
dependency covers every query parameter and every JSON body, whatever schema a route
uses; the body was already read and parsed by FastAPI, so this costs a substring search
per request unless one of those tokens is present.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from fastapi import Request

from queuekeeper.exceptions import BadRequest

NUL = "\x00"
# What a JSON body must contain for the walk below to find anything.
_BODY_TOKENS = (b"\\u0000", b"NaN", b"Infinity")


def _unstorable(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        if NUL in value:
            yield path, "must not contain a NUL character (\\u0000)"
    elif isinstance(value, float):
        if not math.isfinite(value):
            yield path, f"must be a finite number, not {value!r}"
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if NUL in str(key):
                yield child, "a key must not contain a NUL character (\\u0000)"
            yield from _unstorable(item, child)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _unstorable(item, f"{path}.{index}" if path else str(index))


def unstorable_body(body: bytes) -> list[tuple[str, str]]:
    """Where a JSON body holds a NUL character or NaN/Infinity: (field, what is wrong)."""
    if not any(token in body for token in _BODY_TOKENS):
        return []
    try:
        document = json.loads(body)
    except ValueError:
        return []  # a malformed body is refused by whoever parses it, with its position
    return list(_unstorable(document, ""))


def refuse(errors: list[tuple[str, str]]) -> None:
    if errors:
        field = errors[0][0]
        raise BadRequest(
            "; ".join(f"{field or 'body'}: {message}" for field, message in errors[:10]),
            field=field or "body",
            extra={"errors": [{"field": f or "body", "message": m} for f, m in errors[:10]]},
        )


async def reject_unstorable_input(request: Request) -> None:
    """FastAPI dependency: 400 for a NUL character in a query parameter or a JSON string,
    or NaN/Infinity anywhere in a JSON body."""
    errors: list[tuple[str, str]] = []
    for name, value in request.query_params.multi_items():
        if NUL in name or NUL in value:
            errors.append((name.replace(NUL, "\\u0000"), "must not contain a NUL character"))
    content_type = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "PATCH") and "json" in content_type:
        errors.extend(unstorable_body(await request.body()))
    refuse(errors)
