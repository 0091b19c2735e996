"""Query parameters shared by several routes, with the bounds the OpenAPI document shows."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Query
from pydantic import AfterValidator

# A vhost of this installation is named by its owner's uuid; hex or dashed, any case.
VHOST_PATTERN = (
    r"^\s*([0-9a-fA-F]{32}|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}"
    r"-[0-9a-fA-F]{12})\s*$"
)


def _vhost(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return uuid.UUID(value.strip()).hex
    except ValueError:
        raise ValueError(
            f"{value!r} is not a vhost of this installation: a vhost is named by its "
            "owner's uuid (32 hex digits, or the dashed form)"
        ) from None


VhostQuery = Annotated[
    str | None,
    Query(
        description="Only this vhost: the owner's uuid (hex or dashed; answered as hex). "
        "An empty or malformed value is a 400.",
        # Documented (generated clients and fuzzers keep to it), checked by `_vhost` so
        # that the 400 says what a vhost is rather than quoting the expression.
        json_schema_extra={"pattern": VHOST_PATTERN},
    ),
    AfterValidator(_vhost),
]
