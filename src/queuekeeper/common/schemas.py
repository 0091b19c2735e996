"""Types shared by every domain's schemas: uuids out as hex, datetimes as DRF does."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainSerializer

from queuekeeper.exceptions import NotFound, shown

T = TypeVar("T")


def _hex(value: uuid.UUID) -> str:
    return value.hex


def _drf_datetime(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


# Accepts hex, dashed, any case (pydantic's UUID parsing); written as 32-char hex.
HexUUID = Annotated[uuid.UUID, PlainSerializer(_hex, return_type=str, when_used="json")]
UTCDateTime = Annotated[datetime, PlainSerializer(_drf_datetime, return_type=str, when_used="json")]


def _storable(value: datetime) -> datetime:
    """An input datetime in UTC, aware: one without an offset is UTC (contract §14), so
    every comparison with the clock works on it. One whose offset takes it outside years
    1-9999 there (0001-01-01T00:00:00+14:00) is refused as the field's error, not a 500 at
    the insert or at a comparison."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(
            "out of range: in UTC this is before 0001-01-01 or after 9999-12-31"
        ) from None


# Every datetime a request body or a query parameter takes: aware, in UTC (see _storable).
InputDateTime = Annotated[datetime, AfterValidator(_storable)]


class Schema(BaseModel):
    model_config = ConfigDict(from_attributes=True)


def as_uuid(value: Any) -> uuid.UUID | None:
    """`value` as a uuid (hex or dashed, any case); None when it is not one."""
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def parse_path_uuid(value: str) -> uuid.UUID | None:
    """A path uuid in hex or dashed form; None when malformed (the caller answers 404)."""
    return as_uuid(value.strip())


async def find_by_path_uuid(
    value: str, what: str, lookup: Callable[[uuid.UUID], Awaitable[T | None]]
) -> T:
    """What `lookup` finds for a path uuid; NotFound naming `what` when the uuid is malformed
    or names nothing the caller may see (the two are not told apart)."""
    parsed = parse_path_uuid(value)
    found = await lookup(parsed) if parsed else None
    if found is None:
        raise NotFound(f"{what} {shown(value)} not found.")
    return found
