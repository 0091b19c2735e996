"""Agent identities as waldur-site-agent 1.0.5 sends and parses them.

docs/agent-protocols.md, 1.0.5 §2-§3.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from queuekeeper.broker import topology
from queuekeeper.broker.management import QueueInfo
from queuekeeper.common.openapi import limited_by
from queuekeeper.common.schemas import HexUUID, InputDateTime, Schema, UTCDateTime
from queuekeeper.common.urls import api_url
from queuekeeper.config import Settings
from queuekeeper.events.payloads import ObjectType
from queuekeeper.identities.compatibility import Compatibility, assess
from queuekeeper.models import AgentIdentity, BrokerState, EventConsumer, EventSubscription, User

COLLECTION = "marketplace-site-agent-identities"


def _uuid_text(value: str) -> str:
    uuid.UUID(value)  # hex, dashed, any case, {braced}, urn:uuid: (raises ValueError)
    return value


# Kept as sent: its exact form tells us which queue names the agent will compute.
OfferingText = Annotated[
    str,
    AfterValidator(_uuid_text),
    Field(description="The offering uuid, hex or dashed, any case (written as hex in answers)."),
]


class Dependency(BaseModel):
    model_config = ConfigDict(extra="ignore")

    package: str = Field(min_length=1, max_length=255)
    version: str = Field(max_length=255)


class IdentityWrite(BaseModel):
    """Body of POST and PUT. On PUT, optional fields left out keep their stored value."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "offering": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "name": "agent-5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "version": "1.0.5",
                    "dependencies": [{"package": "waldur-api-client", "version": "8.0.9.dev348"}],
                    "config_file_path": "",
                    "config_file_content": "",
                    "last_restarted": "2026-11-21T22:25:36.755464",
                }
            ]
        },
    )

    offering: OfferingText
    name: str = Field(min_length=1, max_length=255, json_schema_extra=limited_by("text_max_length"))
    version: str | None = Field(default=None, max_length=64)
    dependencies: list[Dependency] | None = Field(default=None, max_length=500)
    config_file_path: str | None = Field(default=None, max_length=4096)
    config_file_content: str | None = Field(default=None, max_length=1_000_000)
    last_restarted: InputDateTime | None = Field(
        default=None,
        description="The agent sends naive local time; a value without an offset is taken as "
        "UTC. Defaults to the time of the request.",
    )

    @property
    def offering_uuid(self) -> uuid.UUID:
        return uuid.UUID(self.offering)


_IDENTITY_UUID = "7d1f0c2b9a8e4f6d8c5b4a3e2f1d0c9b"
_OFFERING_UUID = "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b"
_USER_UUID = "8b1a9953c4611296a827abf8c47804d7"
_SUBSCRIPTION_UUID = "0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a"
_CONSUMER_UUID = "0dc92ac0518e4604a2e27ff11120df6c"


class IdentityOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": _IDENTITY_UUID,
                    "url": "https://queuekeeper.example.org/api/"
                    f"marketplace-site-agent-identities/{_IDENTITY_UUID}/",
                    "offering": _OFFERING_UUID,
                    "created_by": _USER_UUID,
                    "name": f"agent-{_OFFERING_UUID}",
                    "version": "1.0.5",
                    "dependencies": [{"package": "waldur-api-client", "version": "8.0.9.dev348"}],
                    "config_file_path": "",
                    "config_file_content": "",
                    "last_restarted": "2026-11-21T22:25:36.755464Z",
                    "services": [],
                    "created": "2026-11-21T22:25:36.857310Z",
                    "modified": "2026-11-21T22:25:36.857310Z",
                    "compatibility": {
                        "status": "compatible",
                        "message": "waldur-site-agent 1.0.5 is supported (minimum 1.0.5).",
                        "minimum_required": "1.0.5",
                    },
                }
            ]
        }
    )

    uuid: HexUUID
    url: str
    offering: HexUUID
    created_by: HexUUID | None = Field(description="The user who registered it (hex), or null.")
    name: str
    version: str | None
    dependencies: list[Dependency]
    config_file_path: str | None
    config_file_content: str | None
    # Never null: waldur-api-client 8.0.9 raises on an explicit null here.
    last_restarted: UTCDateTime
    services: list[dict[str, Any]] = Field(
        description="Always empty: queuekeeper does not track agent services (the agent's "
        "register_service call answers 404, which it logs and ignores)."
    )
    created: UTCDateTime
    modified: UTCDateTime
    # Required by waldur-api-client 8.1.3 (agent 1.0.8), ignored by older clients.
    compatibility: Compatibility = Field(
        description="The reported `version` against the server's minimum agent version "
        "(setting `QUEUEKEEPER_MINIMUM_AGENT_VERSION`)."
    )

    @classmethod
    def from_row(cls, identity: AgentIdentity, settings: Settings) -> IdentityOut:
        return cls(
            uuid=identity.uuid,
            url=api_url(settings, COLLECTION, identity.uuid),
            offering=identity.offering_uuid,
            created_by=identity.created_by,
            name=identity.name,
            version=identity.version,
            dependencies=[Dependency.model_validate(item) for item in identity.dependencies or []],
            config_file_path=identity.config_file_path,
            config_file_content=identity.config_file_content,
            last_restarted=identity.last_restarted or identity.created,
            services=[],
            created=identity.created,
            modified=identity.modified,
            compatibility=assess(identity.version, settings.minimum_agent_version),
        )


class RegisterEventSubscription(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "observable_object_type": "order",
                    "description": "Event subscription created by the site agent for identity "
                    "{identity.name}",
                }
            ]
        },
    )

    observable_object_type: ObjectType
    description: str = Field(
        default="", max_length=10_000, json_schema_extra=limited_by("text_max_length")
    )


class AdminQueue(BaseModel):
    queue_name: str
    vhost: str
    offering_uuid: HexUUID
    present: bool | None = Field(description="On the broker; null when the broker was not asked.")
    consumers: int | None = Field(description="0 on a present queue: the agent is not consuming.")
    messages: int | None


class AdminSubscription(BaseModel):
    object_type: str | None
    subscription_uuid: HexUUID
    broker_state: BrokerState
    created: UTCDateTime
    queues: list[AdminQueue]

    @classmethod
    def from_row(cls, subscription: EventSubscription) -> AdminSubscription:
        """Without its queues; the caller adds them with the broker's view."""
        return cls(
            object_type=subscription.observable_object_type,
            subscription_uuid=subscription.uuid,
            broker_state=subscription.broker_state,
            created=subscription.created,
            queues=[],
        )


class AdminConsumer(BaseModel):
    """The identity's consumer (agents 1.0.7 and later) with its queue as the broker sees it."""

    consumer_uuid: HexUUID
    queue_name: str
    vhost: str
    rmq_username: str
    object_types: list[str] = Field(description="The filter; empty means every type.")
    broker_state: BrokerState
    created: UTCDateTime
    modified: UTCDateTime
    present: bool | None = Field(description="On the broker; null when the broker was not asked.")
    arguments_ok: bool | None = Field(description="Null when not present or not asked.")
    differences: list[str] = Field(description="How the broker's queue differs from contract §3.")
    consumers: int | None = Field(description="0 on a present queue: the agent is not consuming.")
    messages: int | None

    @classmethod
    def from_row(
        cls, consumer: EventConsumer, seen: QueueInfo | None, differences: list[str] | None
    ) -> AdminConsumer:
        """`differences` None: the broker was not asked."""
        asked = differences is not None
        return cls(
            consumer_uuid=consumer.uuid,
            queue_name=consumer.queue_name,
            vhost=consumer.vhost,
            rmq_username=topology.consumer_user_name(consumer.uuid),
            object_types=list(consumer.object_types or []),
            broker_state=consumer.broker_state,
            created=consumer.created,
            modified=consumer.modified,
            present=seen is not None if asked else None,
            arguments_ok=not differences if seen is not None else None,
            differences=differences or [],
            consumers=(seen.consumers or 0) if seen else None,
            messages=(seen.messages or 0) if seen else None,
        )


class AdminIdentityOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": _IDENTITY_UUID,
                    "name": f"agent-{_OFFERING_UUID}",
                    "offering": _OFFERING_UUID,
                    "owner_uuid": _USER_UUID,
                    "owner_username": "site-agent-a",
                    "version": "1.0.5",
                    "last_restarted": "2026-11-21T22:25:36.755464Z",
                    "created": "2026-11-21T22:25:36.857310Z",
                    "modified": "2026-11-22T08:00:00.101010Z",
                    "subscriptions": [
                        {
                            "object_type": "order",
                            "subscription_uuid": _SUBSCRIPTION_UUID,
                            "broker_state": "ok",
                            "created": "2026-11-21T22:25:36.901234Z",
                            "queues": [
                                {
                                    "queue_name": f"subscription_{_SUBSCRIPTION_UUID}"
                                    f"_offering_{_OFFERING_UUID}_order",
                                    "vhost": _USER_UUID,
                                    "offering_uuid": _OFFERING_UUID,
                                    "present": True,
                                    "consumers": 0,
                                    "messages": 12,
                                }
                            ],
                        }
                    ],
                    "consumer": {
                        "consumer_uuid": _CONSUMER_UUID,
                        "queue_name": f"consumer_{_CONSUMER_UUID}",
                        "vhost": _USER_UUID,
                        "rmq_username": _CONSUMER_UUID,
                        "object_types": ["order", "resource_api_key_rotation"],
                        "broker_state": "ok",
                        "created": "2026-11-23T00:51:07.301234Z",
                        "modified": "2026-11-23T01:00:00.123456Z",
                        "present": True,
                        "arguments_ok": True,
                        "differences": [],
                        "consumers": 1,
                        "messages": 0,
                    },
                }
            ]
        }
    )

    uuid: HexUUID
    name: str
    offering: HexUUID
    owner_uuid: HexUUID | None
    owner_username: str | None
    version: str | None
    last_restarted: UTCDateTime | None
    created: UTCDateTime
    modified: UTCDateTime
    subscriptions: list[AdminSubscription] = Field(
        description="What a 1.0.5 agent registered: one subscription per object type."
    )
    consumer: AdminConsumer | None = Field(
        default=None,
        description="What a 1.0.7 agent registered with register_queue: one queue for every "
        "type; null when it has none.",
    )

    @classmethod
    def from_row(
        cls,
        identity: AgentIdentity,
        owner: User | None,
        subscriptions: list[AdminSubscription],
        consumer: AdminConsumer | None = None,
    ) -> AdminIdentityOut:
        return cls(
            uuid=identity.uuid,
            name=identity.name,
            offering=identity.offering_uuid,
            owner_uuid=identity.created_by,
            owner_username=owner.username if owner is not None else None,
            version=identity.version,
            last_restarted=identity.last_restarted,
            created=identity.created,
            modified=identity.modified,
            subscriptions=subscriptions,
            consumer=consumer,
        )
