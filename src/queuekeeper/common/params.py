"""Query parameters shared by several routes, with the bounds the OpenAPI document shows."""

from __future__ import annotations

import re
import uuid
from typing import Annotated

from fastapi import Query
from pydantic import AfterValidator

from queuekeeper.exceptions import shown

# A RabbitMQ vhost name: 1 to 255 characters, no control characters, not starting with
# white space. (This installation's vhosts are named by their owner's uuid; any other
# well-formed name is looked up and answered 404 when it is not one of them.)
VHOST_PATTERN = r"^[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]{0,254}$"
_VHOST = re.compile(VHOST_PATTERN)


def vhost_name(value: str) -> str:
    """A vhost as the caller gave it, in the one form this installation names its vhosts:
    the dashed or upper-case form of an owner's uuid becomes its 32 lowercase hex digits
    (every route taking a vhost, query or body, goes through this). ValueError when it
    cannot be a vhost name at all."""
    if not _VHOST.match(value):
        raise ValueError(
            f"{shown(value)} is not a vhost name: a vhost is named by its owner's uuid "
            "(32 hex digits, or the dashed form)"
        )
    try:
        return uuid.UUID(value).hex  # the dashed or upper-case form of one of ours
    except ValueError:
        return value


def _vhost(value: str | None) -> str | None:
    return None if value is None else vhost_name(value)


VhostQuery = Annotated[
    str | None,
    Query(
        description="Only this vhost: the owner's uuid (hex or dashed; answered as hex). "
        "Empty or malformed (white space first, control characters, over 255 characters) "
        "is a 400.",
        # Documented (generated clients and fuzzers keep to it), checked by `_vhost` so
        # that the 400 says what a vhost is rather than quoting the expression.
        json_schema_extra={"pattern": VHOST_PATTERN},
    ),
    AfterValidator(_vhost),
]
