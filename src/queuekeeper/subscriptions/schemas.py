from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.events.payloads import ObjectType


class ObservableObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object_type: ObjectType
    object_id: str | None = None
    offering_uuid: HexUUID | None = None


class SubscriptionCreate(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "description": "site agent for cluster A",
                    "observable_objects": [{"object_type": "order"}],
                }
            ]
        },
    )

    description: str = Field(default="", max_length=10_000)
    observable_objects: list[ObservableObject] = Field(default_factory=list, max_length=100)


class SubscriptionOut(Schema):
    uuid: HexUUID
    url: str
    user: str = Field(description="URL of the owner's record.")
    user_uuid: HexUUID
    user_username: str
    user_full_name: str
    created: UTCDateTime
    modified: UTCDateTime
    source_ip: str | None
    description: str
    observable_objects: list[dict[str, Any]]


class QueueCreate(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {"offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b", "object_type": "order"}
            ]
        },
    )

    offering_uuid: HexUUID
    object_type: ObjectType


class QueueOut(Schema):
    uuid: HexUUID
    url: str
    event_subscription: str = Field(description="URL of the subscription.")
    event_subscription_uuid: HexUUID
    offering_uuid: HexUUID
    object_type: str
    queue_name: str
    vhost: str
    created: UTCDateTime
