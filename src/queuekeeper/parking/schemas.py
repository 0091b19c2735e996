"""Replay bodies and answers (contract §11)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from queuekeeper.common.params import vhost_name
from queuekeeper.common.schemas import InputDateTime
from queuekeeper.events.payloads import OBJECT_TYPES, ObjectType


class ReplayWindow(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"since": "2026-11-20T18:00:00Z", "until": "2026-11-23T08:00:00Z"}]
        },
    )

    since: InputDateTime = Field(
        description="ISO 8601; events accepted at or after it are replayed. Not in the future, "
        "not older than `QUEUEKEEPER_EVENT_RETENTION_DAYS` (a 400 names the oldest time "
        "available). Without an offset it is read as UTC."
    )
    until: InputDateTime | None = Field(
        default=None,
        description="ISO 8601; events accepted before it. Defaults to now; not before `since`.",
    )
    object_types: list[ObjectType] | None = Field(
        default=None,
        max_length=len(OBJECT_TYPES),
        description="Only these object types; omitted or empty: every type the queue received.",
    )


class ReplayAdminWindow(ReplayWindow):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "queue_name": "consumer_0dc9a3e1b2f84c7d9e6a5b4c3d2e1f00",
                    "vhost": "8b1a0c2d3e4f5a6b7c8d9e0f1a2b3c4d",
                    "since": "2026-11-20T18:00:00Z",
                    "until": "2026-11-23T08:00:00Z",
                }
            ]
        },
    )

    queue_name: str = Field(min_length=1, max_length=255, description="A registered queue.")
    # Normalised as `GET /api/admin/queues/?vhost=` does: the dashed or upper-case form of
    # a vhost that listing shows is the same vhost here.
    vhost: Annotated[str, AfterValidator(vhost_name)] = Field(
        min_length=1,
        max_length=64,
        description="Its vhost: the owner's uuid (hex or dashed, any case).",
    )


class ReplayOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"replayed": 412}]})

    replayed: int = Field(
        description="Copies written to the outbox, published in acceptance order with their "
        'original `message_id` and the header `x-queuekeeper-replay: "true"`.'
    )
