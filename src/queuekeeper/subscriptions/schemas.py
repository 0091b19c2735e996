from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.openapi import limited_by
from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.common.urls import api_url
from queuekeeper.config import Settings
from queuekeeper.events.payloads import ObjectType
from queuekeeper.models import EventSubscription, EventSubscriptionQueue, User


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

    description: str = Field(
        default="", max_length=10_000, json_schema_extra=limited_by("text_max_length")
    )
    observable_objects: list[ObservableObject] = Field(default_factory=list, max_length=100)


class SubscriptionOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a",
                    "url": "https://queuekeeper.example.org/api/event-subscriptions/0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a/",
                    "user": "https://queuekeeper.example.org/api/users/8b1a9953c4611296a827abf8c47804d7/",
                    "user_uuid": "8b1a9953c4611296a827abf8c47804d7",
                    "user_username": "site-agent-a",
                    "user_full_name": "Site agent A",
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                    "source_ip": "192.0.2.10",
                    "description": "site agent for cluster A",
                    "observable_objects": [{"object_type": "order"}],
                }
            ]
        }
    )

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

    @classmethod
    def from_row(
        cls, subscription: EventSubscription, owner: User, settings: Settings
    ) -> SubscriptionOut:
        return cls(
            uuid=subscription.uuid,
            url=api_url(settings, "event-subscriptions", subscription.uuid),
            user=api_url(settings, "users", owner.uuid),
            user_uuid=owner.uuid,
            user_username=owner.username,
            user_full_name=owner.full_name,
            created=subscription.created,
            modified=subscription.modified,
            source_ip=subscription.source_ip,
            description=subscription.description,
            observable_objects=list(subscription.observable_objects or []),
        )


@dataclass(frozen=True)
class QueueFilter:
    """The `GET /api/event-subscription-queues/` filters; None matches anything."""

    offering_uuid: uuid.UUID | None = None
    object_type: str | None = None
    event_subscription_uuid: uuid.UUID | None = None


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
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "c3a1e2d4f5b64789a0b1c2d3e4f5a6b7",
                    "url": "https://queuekeeper.example.org/api/event-subscription-queues/"
                    "c3a1e2d4f5b64789a0b1c2d3e4f5a6b7/",
                    "event_subscription": "https://queuekeeper.example.org/api/"
                    "event-subscriptions/0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a/",
                    "event_subscription_uuid": "0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a",
                    "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "object_type": "order",
                    "queue_name": "subscription_0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a"
                    "_offering_5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b_order",
                    "vhost": "8b1a9953c4611296a827abf8c47804d7",
                    "created": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    url: str
    event_subscription: str = Field(description="URL of the subscription.")
    event_subscription_uuid: HexUUID
    offering_uuid: HexUUID
    object_type: str
    queue_name: str
    vhost: str
    created: UTCDateTime

    @classmethod
    def from_row(cls, queue: EventSubscriptionQueue, settings: Settings) -> QueueOut:
        return cls(
            uuid=queue.uuid,
            url=api_url(settings, "event-subscription-queues", queue.uuid),
            event_subscription=api_url(settings, "event-subscriptions", queue.subscription_uuid),
            event_subscription_uuid=queue.subscription_uuid,
            offering_uuid=queue.offering_uuid,
            object_type=queue.object_type,
            queue_name=queue.queue_name,
            vhost=queue.vhost,
            created=queue.created,
        )
