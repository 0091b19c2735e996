"""Types shared by every domain's schemas: uuids out as hex, datetimes as DRF does."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, PlainSerializer


def _hex(value: uuid.UUID) -> str:
    return value.hex


def _drf_datetime(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


# Accepts hex, dashed, any case (pydantic's UUID parsing); written as 32-char hex.
HexUUID = Annotated[uuid.UUID, PlainSerializer(_hex, return_type=str, when_used="json")]
UTCDateTime = Annotated[datetime, PlainSerializer(_drf_datetime, return_type=str, when_used="json")]


class Schema(BaseModel):
    model_config = ConfigDict(from_attributes=True)


def parse_path_uuid(value: str) -> uuid.UUID | None:
    """A path uuid in hex or dashed form; None when malformed (the caller answers 404)."""
    try:
        return uuid.UUID(value.strip())
    except (ValueError, AttributeError):
        return None
