"""Bodies and answers of the events API (contract §5)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from sqlalchemy import Row

from queuekeeper.common.openapi import limited_by
from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.events.payloads import ObjectType
from queuekeeper.events.recipients import NoCopyReason
from queuekeeper.models import DeliveryState, Event

if TYPE_CHECKING:
    from queuekeeper.events.repository import OutboxDepth

# Offerings one event may name in `offering_uuids` (a provider's live offerings).
MAX_FAN_OUT = 1000

_EVENT_EXAMPLE: dict[str, Any] = {
    "event_id": "0b5a4e3c2f1d4e6fa7b8c9d0e1f2a3b4",
    "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
    "object_type": "order",
    "payload": {
        "order_uuid": "9d2b5c0e3a8f4e1b8c7d6e5f4a3b2c1d",
        "order_state": "executing",
        "action": "create",
    },
}


class EventIn(BaseModel):
    """One event. `payload` is checked against the object type's model (extra fields kept)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [_EVENT_EXAMPLE]})

    event_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:~+=@-]+$",
        description="Your id for the event (letters, digits and `. _ : ~ + = @ -`); the AMQP "
        "`message_id` of every copy. A repeated id is accepted once. A hex uuid is made up "
        "when it is left out.",
    )
    offering_uuid: HexUUID | None = Field(
        default=None,
        description="The offering the event concerns (or `offering_uuids`). Optional for an "
        "identity event (`user_role`, `user_profile`, `user_ssh_key`, `user_lifecycle`) that "
        "names `subject_user_uuid`.",
    )
    offering_uuids: list[HexUUID] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_FAN_OUT,
        description="Instead of `offering_uuid`, for an event that concerns several "
        "offerings (a service provider's project group goes to each of its offerings, as "
        "Waldur sends it): one event, one `event_id`, and each copy's body and headers carry "
        "the `offering_uuid` of the queue it goes to. Exactly one of the two.",
    )
    project_uuid: HexUUID | None = Field(
        default=None,
        description="The consumer-side project of an order or resource (pushed first): "
        "consumers bound to it or its customer receive the event.",
    )
    subject_user_uuid: HexUUID | None = Field(
        default=None,
        description="The user an identity event is about (pushed first): the consumers "
        "that user bound to itself receive it.",
    )
    object_type: ObjectType
    payload: dict[str, Any] = Field(default_factory=dict)
    user_uuids: list[HexUUID] | None = Field(
        default=None,
        max_length=10_000,
        description="Only these users' queues receive the event (still only with access).",
    )

    @property
    def offerings(self) -> list[uuid.UUID]:
        """Every offering the event goes to, the first being the one it is stored under."""
        if self.offering_uuids is not None:
            return self.offering_uuids
        # services.validate_payloads refuses an event with neither before it gets here
        return [self.offering_uuid] if self.offering_uuid is not None else []


class EventBatchIn(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "events": [
                        _EVENT_EXAMPLE,
                        {
                            "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                            "object_type": "resource",
                            "payload": {"resource_uuid": "1a2b3c4d5e6f40718293a4b5c6d7e8f9"},
                            "user_uuids": ["7c9e6679742541de944be07fc1f90ae7"],
                        },
                    ]
                }
            ]
        },
    )

    events: list[EventIn] = Field(
        description="Events stored in one transaction.",
        json_schema_extra=limited_by("events_batch_max"),
    )


class DeliveryOut(BaseModel):
    queue_name: str
    vhost: str
    state: DeliveryState
    reason: str | None = Field(
        default=None,
        description="A copy not `published` when the wait ended: why (the relay's last "
        "failure, e.g. the broker unreachable, or that it was not confirmed in time).",
    )


_ACCEPTED_EXAMPLE: dict[str, JsonValue] = {
    "event_id": "order-42-created",
    "queued": 1,
    "skipped_unregistered": 0,
    "duplicate": False,
}
_DELIVERY_EXAMPLE: dict[str, JsonValue] = {
    "queue_name": "subscription_8d2f0c1e9b7a4e4f9c3b2a1d0e9f8a7b"
    "_offering_5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b_order",
    "vhost": "3b1f5c2d7e8a4b9c8d7e6f5a4b3c2d1e",
    "state": "published",
}


class EventAccepted(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                _ACCEPTED_EXAMPLE,
                {**_ACCEPTED_EXAMPLE, "deliveries": [_DELIVERY_EXAMPLE]},
            ]
        }
    )

    event_id: str
    queued: int = Field(description="Copies written to the outbox, one per recipient queue.")
    skipped_unregistered: int = Field(
        description="Subscriptions that would have received the event but registered no queue "
        "for this offering and object type."
    )
    duplicate: bool = Field(description="The event_id was accepted before; nothing was sent.")
    no_copy_reason: NoCopyReason | None = Field(
        default=None,
        description="Only when `queued` is 0: why no copy was made. `no_agent`: no agent of a "
        "user with access (active, token unexpired) has set up for this offering; "
        "`no_registered_queue`: agents subscribed to this type but registered no queue for "
        "it (`skipped_unregistered`); `all_recipients_filtered`: agents set up for the "
        "offering, but none for this type or none of `user_uuids`; `duplicate`: the "
        "`event_id` was accepted before and made no copy then either. Nothing is kept for a "
        "later agent: send the event again, under a new `event_id`, once it has set up.",
    )
    deliveries: list[DeliveryOut] | None = Field(
        default=None, description="Only with `?wait=true`: the state of every copy."
    )


class EventBatchAccepted(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"events": [_ACCEPTED_EXAMPLE]}]})

    events: list[EventAccepted]


class DeliveryDetail(Schema):
    queue_name: str
    vhost: str
    state: DeliveryState
    attempts: int = Field(description="Publish attempts so far (claims by a relay).")
    last_error: str | None = Field(
        description="Why the last attempt failed, or why the copy was rejected or given up."
    )
    created: UTCDateTime
    next_attempt_at: UTCDateTime | None = Field(
        description="When a pending copy is due (the lease's end while a relay holds it)."
    )
    claimed_by: str | None = Field(description="The relay holding a pending copy right now.")
    claimed_until: UTCDateTime | None
    finished: UTCDateTime | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> DeliveryDetail:
        detail = cls.model_validate(row)
        if detail.state != DeliveryState.PENDING:
            detail.next_attempt_at = None  # a settled copy is due never, whatever the row says
        return detail


class EventDetail(Schema):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "event_id": "order-42-created",
                    "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "object_type": "order",
                    "user_uuids": None,
                    "accepted": "2026-11-21T22:25:36.857310Z",
                    "queued": 1,
                    "skipped_unregistered": 0,
                    "body": {
                        "order_uuid": "0b9a3c1e5d5e4f4e8a3b1c2d3e4f5a6b",
                        "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                        "object_type": "order",
                    },
                    "deliveries": [
                        {
                            **_DELIVERY_EXAMPLE,
                            "attempts": 1,
                            "last_error": None,
                            "created": "2026-11-21T22:25:36.857310Z",
                            "next_attempt_at": None,
                            "claimed_by": None,
                            "claimed_until": None,
                            "finished": "2026-11-21T22:25:36.871002Z",
                        }
                    ],
                }
            ]
        },
    )

    event_id: str
    offering_uuid: HexUUID | None = Field(
        description="The event's (first) offering; null for an identity event without one."
    )
    offering_uuids: list[str] | None = Field(
        default=None, description="Every offering of an event sent with `offering_uuids`."
    )
    project_uuid: HexUUID | None = Field(default=None, description="As sent.")
    subject_user_uuid: HexUUID | None = Field(default=None, description="As sent.")
    object_type: str
    user_uuids: list[str] | None
    accepted: UTCDateTime
    queued: int
    skipped_unregistered: int
    body: dict[str, Any] = Field(description="The message body every copy carries.")
    deliveries: list[DeliveryDetail]

    @classmethod
    def from_row(cls, event: Event, deliveries: Sequence[Row[Any]]) -> EventDetail:
        return cls(
            event_id=event.event_id,
            offering_uuid=event.offering_uuid,
            offering_uuids=event.offering_uuids,
            project_uuid=event.project_uuid,
            subject_user_uuid=event.subject_user_uuid,
            object_type=event.object_type,
            user_uuids=event.user_uuids,
            accepted=event.accepted,
            queued=event.queued,
            skipped_unregistered=event.skipped_unregistered,
            body=event.payload,
            deliveries=[DeliveryDetail.from_row(row) for row in deliveries],
        )


class OutboxStats(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"pending": 12, "claimed": 10, "oldest_pending_age_seconds": 0.8}]
        }
    )

    pending: int = Field(description="Copies not yet confirmed, rejected or given up.")
    claimed: int = Field(description="Pending copies a relay holds right now (lease running).")
    oldest_pending_age_seconds: float = Field(description="0 when nothing is pending.")

    @classmethod
    def from_row(cls, depth: OutboxDepth) -> OutboxStats:
        return cls(
            pending=depth.pending,
            claimed=depth.claimed,
            oldest_pending_age_seconds=depth.oldest_pending_age_seconds,
        )
