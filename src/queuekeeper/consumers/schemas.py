"""Consumer bodies and answers, shaped as waldur-api-client 8.1.2's models.

`AgentQueueRegistrationRequest` / `EventConsumerRegistrationRequest` in,
`AgentQueueRegistrationResponse` / `EventConsumerRegistrationResponse` and
`EventConsumer` out. Extra fields in answers are tolerated by that client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from queuekeeper.broker import topology
from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.events.payloads import OBJECT_TYPES, ObjectType
from queuekeeper.models import EventConsumer

_CONSUMER_UUID = "0dc92ac0518e4604a2e27ff11120df6c"
_USER_UUID = "8b1a9953c4611296a827abf8c47804d7"
_OFFERING_UUID = "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b"
_IDENTITY_UUID = "7d1f0c2b9a8e4f6d8c5b4a3e2f1d0c9b"


def _no_duplicates(values: list[str] | None) -> list[str] | None:
    if values is not None:
        seen: set[str] = set()
        for value in values:
            if value in seen:
                raise ValueError(f"{value!r} is listed twice")
            seen.add(value)
    return values


ObjectTypes = list[ObjectType] | None
OBJECT_TYPES_DESCRIPTION = (
    "Object types to receive. Omitted (or null) keeps the current filter (all types for a "
    "new consumer); `[]` means all types; a list replaces the filter. Every value of "
    "waldur-api-client 8.1.2's `ObservableObjectTypeEnum` is accepted, each at most once."
)


class QueueRegistration(BaseModel):
    """`AgentQueueRegistrationRequest`: what waldur-site-agent 1.0.7 sends on every start."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "object_types": [
                        "order",
                        "resource_api_key_rotation",
                        "user_role",
                        "resource",
                        "service_account",
                        "course_account",
                        "offering_user",
                        "offering_resources_sync",
                        "importable_resources",
                        "resource_periodic_limits",
                    ]
                }
            ]
        },
    )

    object_types: ObjectTypes = Field(
        default=None, max_length=len(OBJECT_TYPES), description=OBJECT_TYPES_DESCRIPTION
    )

    _unique = field_validator("object_types")(_no_duplicates)


class ScopeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["offering"] = Field(description="Only offerings can be bound for now.")
    uuid: HexUUID


class ConsumerRegistration(BaseModel):
    """`EventConsumerRegistrationRequest`, for integrations that are not site agents."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "object_types": ["order", "resource"],
                    "scopes": [{"type": "offering", "uuid": _OFFERING_UUID}],
                }
            ]
        },
    )

    object_types: ObjectTypes = Field(
        default=None, max_length=len(OBJECT_TYPES), description=OBJECT_TYPES_DESCRIPTION
    )
    scopes: list[ScopeIn] = Field(
        min_length=1,
        max_length=100,
        description="The offerings whose events it receives; you need access to each. A "
        "registration with the same set of offerings returns your existing consumer. Global "
        "consumers (no scopes) are not offered.",
    )

    _unique = field_validator("object_types")(_no_duplicates)

    @field_validator("scopes")
    @classmethod
    def _distinct_scopes(cls, scopes: list[ScopeIn]) -> list[ScopeIn]:
        if len({scope.uuid for scope in scopes}) != len(scopes):
            raise ValueError("an offering is listed twice")
        return scopes


def effective_types(consumer: EventConsumer) -> list[str]:
    """What the consumer receives: its filter, or every type when the filter is empty."""
    return list(consumer.object_types or OBJECT_TYPES)


class RegistrationOut(BaseModel):
    """`AgentQueueRegistrationResponse` (= `EventConsumerRegistrationResponse`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "rmq_username": _CONSUMER_UUID,
                    "queue_name": f"consumer_{_CONSUMER_UUID}",
                    "vhost": _USER_UUID,
                    "observable_object_types": ["order", "resource_api_key_rotation"],
                }
            ]
        }
    )

    rmq_username: str = Field(description="STOMP `login`; the password is your API token.")
    queue_name: str = Field(description="Subscribe to `/amq/queue/<queue_name>`.")
    vhost: str = Field(description="STOMP `host`: your user uuid hex.")
    observable_object_types: list[str] = Field(
        description="The object types routed to this queue (every type when the filter is empty)."
    )

    @classmethod
    def from_row(cls, consumer: EventConsumer) -> RegistrationOut:
        return cls(
            rmq_username=topology.consumer_user_name(consumer.uuid),
            queue_name=consumer.queue_name,
            vhost=consumer.vhost,
            observable_object_types=effective_types(consumer),
        )


class ScopeOut(BaseModel):
    type: str | None
    uuid: str | None


class ConsumerOut(Schema):
    """`EventConsumer`, plus where its queue is and who owns it."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": _CONSUMER_UUID,
                    "object_types": [],
                    "scopes": [{"type": "offering", "uuid": _OFFERING_UUID}],
                    "is_global": False,
                    "rmq_username": _CONSUMER_UUID,
                    "queue_created": True,
                    "created": "2026-11-23T00:51:07.301234Z",
                    "modified": "2026-11-23T00:51:07.301234Z",
                    "queue_name": f"consumer_{_CONSUMER_UUID}",
                    "vhost": _USER_UUID,
                    "user_uuid": _USER_UUID,
                    "agent_identity_uuid": _IDENTITY_UUID,
                }
            ]
        }
    )

    uuid: HexUUID
    object_types: list[str] = Field(description="The filter; empty means every type.")
    scopes: list[ScopeOut]
    is_global: bool = Field(description="Always false: consumers are bound to offerings.")
    rmq_username: str
    queue_created: bool = Field(
        description="Always true: a consumer is stored only once its queue exists."
    )
    created: UTCDateTime
    modified: UTCDateTime
    queue_name: str
    vhost: str
    user_uuid: HexUUID
    agent_identity_uuid: HexUUID | None = Field(
        description="The site agent identity it was registered for (register_queue), or null."
    )

    @classmethod
    def from_row(cls, consumer: EventConsumer) -> ConsumerOut:
        return cls(
            uuid=consumer.uuid,
            object_types=list(consumer.object_types or []),
            scopes=[
                ScopeOut(type="offering", uuid=scope.offering_uuid.hex)
                for scope in sorted(consumer.scopes, key=lambda scope: scope.offering_uuid.hex)
            ],
            is_global=False,
            rmq_username=topology.consumer_user_name(consumer.uuid),
            queue_created=True,
            created=consumer.created,
            modified=consumer.modified,
            queue_name=consumer.queue_name,
            vhost=consumer.vhost,
            user_uuid=consumer.user_uuid,
            agent_identity_uuid=consumer.agent_identity_uuid,
        )
