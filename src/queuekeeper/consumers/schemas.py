"""Consumer bodies and answers, shaped as waldur-api-client 8.1.4's models (which 8.1.3's and
8.1.2's parse too: they ignore the fields they do not know).

`AgentQueueRegistrationRequest` / `EventConsumerRegistrationRequest` in,
`AgentQueueRegistrationResponse` / `EventConsumerRegistrationResponse` and
`EventConsumer` out. Extra fields in answers are tolerated by every client.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from queuekeeper.broker import topology
from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.common.urls import destination
from queuekeeper.events.payloads import OBJECT_TYPES, ObjectType
from queuekeeper.models import EventConsumer

_CONSUMER_UUID = "0dc92ac0518e4604a2e27ff11120df6c"
_USER_UUID = "8b1a9953c4611296a827abf8c47804d7"
_OFFERING_UUID = "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b"
_IDENTITY_UUID = "7d1f0c2b9a8e4f6d8c5b4a3e2f1d0c9b"
_CUSTOMER_UUID = "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6"


def no_duplicates(values: list[str] | None) -> list[str] | None:
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
    "waldur-api-client 8.1.3's `ObservableObjectTypeEnum` is accepted, each at most once."
)


class QueueRegistration(BaseModel):
    """`AgentQueueRegistrationRequest`: what waldur-site-agent 1.0.7 and later send on every
    start."""

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

    _unique = field_validator("object_types")(no_duplicates)


ScopeType = Literal["offering", "project", "customer", "user"]
# Bindings one consumer may hold.
MAX_SCOPES = 100
MAX_PAYLOAD_FILTER_FIELDS = 20
MAX_PAYLOAD_FILTER_VALUES = 100


class ScopeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: ScopeType = Field(
        description="`offering` (granted, or a role on it, its customer or its project), "
        "`project` (a role on it or its customer), `customer` (a role on it), `user` "
        "(yourself; another user for staff and support only)."
    )
    uuid: HexUUID


def distinct_scopes(scopes: list[ScopeIn] | None) -> list[ScopeIn] | None:
    seen: set[tuple[str, str]] = set()
    for scope in scopes or []:
        key = (scope.type, scope.uuid.hex)
        if key in seen:
            raise ValueError(f"{scope.type} {scope.uuid.hex} is listed twice")
        seen.add(key)
    return scopes


PayloadFilters = dict[
    str, Annotated[list[JsonValue], Field(min_length=1, max_length=MAX_PAYLOAD_FILTER_VALUES)]
]


class ConsumerRegistration(BaseModel):
    """`EventConsumerRegistrationRequest`, for integrations that are not site agents."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "object_types": ["order", "resource"],
                    "scopes": [{"type": "offering", "uuid": _OFFERING_UUID}],
                },
                {
                    "object_types": ["user_role"],
                    "scopes": [
                        {"type": "customer", "uuid": _CUSTOMER_UUID},
                        {"type": "user", "uuid": _USER_UUID},
                    ],
                    "payload_filters": {"action": ["create", "delete"]},
                },
            ]
        },
    )

    object_types: ObjectTypes = Field(
        default=None, max_length=len(OBJECT_TYPES), description=OBJECT_TYPES_DESCRIPTION
    )
    scopes: list[ScopeIn] = Field(
        max_length=MAX_SCOPES,
        description="The entities whose events it receives, each at most once. `[]` means "
        "global (every event), for staff and support users only. A registration with the "
        "same set returns your existing consumer.",
    )
    payload_filters: PayloadFilters | None = Field(
        default=None,
        max_length=MAX_PAYLOAD_FILTER_FIELDS,
        description="`{field: [values]}`: a copy is made only when each listed top-level "
        "field of the message holds one of its values. Omitted keeps the current filters "
        "(none for a new consumer); `{}` removes them.",
    )

    _unique = field_validator("object_types")(no_duplicates)
    _distinct = field_validator("scopes")(distinct_scopes)


class ResyncOut(BaseModel):
    """`EventConsumerResyncResponse` (client 8.1.4)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"object_types": ["user_role"]}]})

    object_types: list[str] = Field(
        description="The object types whose current state is sent: `user_role`."
    )
    copies: int = Field(
        default=0,
        description="How many snapshots were queued for the consumer (the grants it may "
        "receive, through its bindings and filters).",
    )


DeliveryState = Literal["pending", "delivered", "parked", "given_up"]


class DeliveryFilters(BaseModel):
    """The filters of `GET /api/event-consumers/{uuid}/deliveries/` (contract §14)."""

    state: DeliveryState | None = None
    event_id: str | None = None
    object_type: str | None = None
    accepted_after: datetime | None = None
    accepted_before: datetime | None = None


class AttemptOut(BaseModel):
    """One attempt of a copy: when it ended, how long it took, the answer, what failed."""

    at: UTCDateTime
    duration_ms: int | None = Field(description="How long the attempt took; null if unknown.")
    status: int | str | None = Field(
        description="A webhook's HTTP status (null when none came); a queue copy's "
        "`confirmed`, `returned` or `nacked` (null when the broker did not answer)."
    )
    error: str | None = Field(description="What went wrong; null when it was delivered.")


class DeliveryOut(BaseModel):
    """One copy of an event for this consumer (contract §14)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "event_id": "order-42",
                    "object_type": "order",
                    "accepted_at": "2026-11-23T01:02:03.456789Z",
                    "state": "pending",
                    "replay": False,
                    "attempts": 2,
                    "last_attempt_at": "2026-11-23T01:02:05.120000Z",
                    "next_attempt_at": "2026-11-23T01:02:30.000000Z",
                    "delivered_at": None,
                    "last_status": 503,
                    "last_error": "HTTP 503",
                    "given_up_reason": None,
                }
            ]
        }
    )

    event_id: str
    object_type: str
    accepted_at: UTCDateTime = Field(description="When its event was accepted.")
    state: DeliveryState
    replay: bool = Field(description="A replay's copy (its event sent again).")
    attempts: int
    last_attempt_at: UTCDateTime | None
    next_attempt_at: UTCDateTime | None = Field(description="Null unless pending.")
    delivered_at: UTCDateTime | None = Field(
        description="A webhook's 2xx; a queue copy's broker confirm. Null until then."
    )
    last_status: int | str | None = Field(
        description="The last HTTP status of a webhook (null when none came); a queue copy's "
        "`confirmed`, `returned` or `nacked`."
    )
    last_error: str = Field(description="What went wrong last; empty when nothing did.")
    given_up_reason: str | None = Field(
        description="Null unless given up: `not_authorized`, `retention`, `consumer_deleted`, "
        "`webhook_gone`, `queue_gone`, `queue_full`, `too_old`."
    )

    @classmethod
    def fields_of(cls, row: Mapping[Any, Any]) -> dict[str, Any]:
        """The answer's fields from a row of `repository.copies_page`."""
        state = _LISTED_AS[str(row["state"])]
        status = row["last_status"]
        return {
            "event_id": row["event_id"],
            "object_type": row["object_type"],
            "accepted_at": row["accepted"],
            "state": state,
            "replay": bool(row["replay"]),
            "attempts": row["attempts"],
            "last_attempt_at": row["last_attempt_at"],
            "next_attempt_at": row["next_attempt_at"] if state == "pending" else None,
            "delivered_at": row["finished"] if state == "delivered" else None,
            # A webhook's status is its HTTP code.
            "last_status": int(status) if status is not None and status.isdigit() else status,
            "last_error": row["last_error"] or "",
            "given_up_reason": (row["given_up_reason"] or "unknown")
            if state == "given_up"
            else None,
        }

    @classmethod
    def of(cls, row: Mapping[Any, Any]) -> DeliveryOut:
        return cls(**cls.fields_of(row))


# The copy states as the API names them (contract §14).
_LISTED_AS: dict[str, DeliveryState] = {
    "pending": "pending",
    "published": "delivered",
    "parked": "parked",
    "given_up": "given_up",
    "rejected": "given_up",
}


class DeliveryDetailOut(DeliveryOut):
    """A copy with its last 20 attempts, oldest first."""

    attempt_log: list[AttemptOut] = Field(
        description="The last 20 attempts, oldest first: `{at, duration_ms, status, error}`."
    )

    @classmethod
    def of_detail(cls, row: Mapping[Any, Any]) -> DeliveryDetailOut:
        return cls(**cls.fields_of(row), attempt_log=list(row["attempt_log"] or []))


def bindings_of(consumer: EventConsumer) -> list[tuple[str, uuid.UUID]]:
    """Every binding of the consumer, offerings included, sorted by type then uuid."""
    found = [("offering", scope.offering_uuid) for scope in consumer.scopes] + [
        (binding.scope_type, binding.scope_uuid) for binding in consumer.bindings
    ]
    return sorted(found, key=lambda pair: (pair[0], pair[1].hex))


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


AuthorizedVia = Literal["self", "staff"]
# At most this many leading characters of a token are shown, and at most a quarter of it.
TOKEN_PREFIX_MAX = 8


def token_prefix(token: str) -> str:
    """`auth_token_prefix`: enough to tell tokens apart, never enough to matter."""
    return token[: min(TOKEN_PREFIX_MAX, len(token) // 4)]


Delivery = Literal["rmq", "webhook"]
# The reasons of `GET /api/event-consumers/{uuid}/status/` (contract §11) that the database
# alone can tell, so that a list page costs no broker call: the same words.
RowBlockedReason = Literal[
    "owner_inactive",
    "no_token",
    "token_expired",
    "no_access",
    "agent_away",
    "webhook_gone",
    "webhook_failing",
]


@dataclass(frozen=True)
class ConsumerFacts:
    """What a consumer answer says beyond the row, read for a whole page at once."""

    last_delivered_at: datetime | None = None
    delivery_blocked_reason: RowBlockedReason | None = None


class DeliveryFields(BaseModel):
    """The fields waldur-api-client 8.1.4 requires on every consumer (contract §12)."""

    delivery: Delivery = Field(
        default="rmq",
        description="`rmq`: copies wait in a queue read over STOMP; `webhook`: they are "
        "POSTed to the consumer's URL.",
    )
    webhook_destination: str | None = Field(
        default=None,
        description="A webhook's scheme and host (and port); never its path, query or "
        "credentials (the URL is a secret). Null for an `rmq` consumer.",
    )
    payload_filters: dict[str, list[JsonValue]] = Field(
        default_factory=dict,
        description="`{field: [values]}` over the message's top-level fields; `{}`: none.",
    )
    last_delivered_at: UTCDateTime | None = Field(
        default=None,
        description="When the broker last confirmed a copy for it (a webhook: when its "
        "receiver last answered 2xx), or null.",
    )
    last_error: str = Field(
        default="",
        description="A webhook's last failed attempt (`HTTP 503`, `timeout after 10 s`, "
        "...); empty when none, and always for an `rmq` consumer.",
    )
    last_error_at: UTCDateTime | None = Field(
        default=None, description="When `last_error` happened; null when none."
    )
    delivery_blocked_reason: RowBlockedReason | None = Field(
        default=None,
        description="Why events cannot reach it, as far as the database tells (the owner "
        "inactive, without a token or with an expired one, without access to what it binds, "
        "its agent away long enough for copies to park, a webhook whose receiver answered "
        "410 (`webhook_gone`: update it to resume) or whose last attempt failed "
        "(`webhook_failing`)); null otherwise. "
        "`GET /api/event-consumers/{uuid}/status/` adds what the broker tells.",
    )

    @classmethod
    def of(cls, consumer: EventConsumer, facts: ConsumerFacts) -> dict[str, Any]:
        webhook = consumer.delivery == "webhook"
        return cls(
            delivery="webhook" if webhook else "rmq",
            webhook_destination=(
                destination(consumer.webhook_url) if webhook and consumer.webhook_url else None
            ),
            payload_filters=dict(consumer.payload_filters or {}),
            # A webhook's deliveries are settled on its row by the dispatcher.
            last_delivered_at=consumer.last_delivered_at if webhook else facts.last_delivered_at,
            last_error=consumer.last_error or "",
            last_error_at=consumer.last_error_at,
            delivery_blocked_reason=facts.delivery_blocked_reason,
        ).model_dump()


class ConsumerRegistrationOut(RegistrationOut, DeliveryFields):
    """`EventConsumerRegistrationResponse`, with the consumer's 8.1.4 fields beside it."""

    @classmethod
    def of_row(cls, consumer: EventConsumer, facts: ConsumerFacts) -> ConsumerRegistrationOut:
        return cls(
            **RegistrationOut.from_row(consumer).model_dump(), **DeliveryFields.of(consumer, facts)
        )


class ConsumerOut(DeliveryFields, Schema):
    """`EventConsumer` (client 8.1.4), plus where its queue is."""

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
                    "user_uuid": _USER_UUID,
                    "user_username": "site-agent-a",
                    "user_full_name": "Site agent A",
                    "user_is_staff": False,
                    "auth_kind": "token",
                    "auth_token_prefix": "3f9a1c0b",
                    "auth_token_name": "",
                    "authorized_via": "self",
                    "delivery_blocked_reason": None,
                    "delivery": "rmq",
                    "webhook_destination": None,
                    "payload_filters": {},
                    "last_delivered_at": "2026-11-23T01:02:03.456789Z",
                    "last_error": "",
                    "last_error_at": None,
                    "created": "2026-11-23T00:51:07.301234Z",
                    "modified": "2026-11-23T00:51:07.301234Z",
                    "queue_name": f"consumer_{_CONSUMER_UUID}",
                    "vhost": _USER_UUID,
                    "agent_identity_uuid": _IDENTITY_UUID,
                }
            ]
        }
    )

    uuid: HexUUID
    object_types: list[str] = Field(description="The filter; empty means every type.")
    scopes: list[ScopeOut]
    is_global: bool = Field(
        description="Registered with no scopes: every event (staff and support only)."
    )
    rmq_username: str = Field(description="Empty for a webhook consumer (no broker user).")
    queue_created: bool = Field(
        description="True for an `rmq` consumer (stored only once its queue exists); false "
        "for a webhook consumer, which has no queue."
    )
    user_uuid: HexUUID
    user_username: str
    user_full_name: str
    user_is_staff: bool = Field(description="The owner is a staff user (as the backend says).")
    auth_kind: Literal["token"] = Field(
        description="How it was registered: always with an API token here."
    )
    auth_token_prefix: str = Field(
        description="The first characters of the token that last registered it (at most 8, "
        "and at most a quarter of the token)."
    )
    auth_token_name: str = Field(description="Always empty: API tokens have no names here.")
    authorized_via: AuthorizedVia = Field(
        description="Why you see it: `self` (you own it) or `staff` (a service token)."
    )
    created: UTCDateTime
    modified: UTCDateTime
    queue_name: str
    vhost: str
    agent_identity_uuid: HexUUID | None = Field(
        description="The site agent identity it was registered for (register_queue), or null."
    )

    @classmethod
    def from_row(
        cls, consumer: EventConsumer, facts: ConsumerFacts, *, as_staff: bool
    ) -> ConsumerOut:
        """`as_staff`: the caller is a service token, not the owner."""
        webhook = consumer.delivery == "webhook"
        return cls(
            **DeliveryFields.of(consumer, facts),
            uuid=consumer.uuid,
            object_types=list(consumer.object_types or []),
            scopes=[ScopeOut(type=kind, uuid=entity.hex) for kind, entity in bindings_of(consumer)],
            is_global=consumer.is_global,
            rmq_username="" if webhook else topology.consumer_user_name(consumer.uuid),
            queue_created=not webhook,
            user_uuid=consumer.user_uuid,
            user_username=consumer.owner.username,
            user_full_name=consumer.owner.full_name or "",
            user_is_staff=consumer.owner.is_staff,
            auth_kind="token",
            auth_token_prefix=consumer.auth_token_prefix or "",
            auth_token_name="",
            authorized_via="staff" if as_staff else "self",
            created=consumer.created,
            modified=consumer.modified,
            queue_name=consumer.queue_name,
            vhost=consumer.vhost,
            agent_identity_uuid=consumer.agent_identity_uuid,
        )


class ConsumerFilters(BaseModel):
    """The list filters of client 8.1.3's `event_consumers_list` / `_count`."""

    user_uuid: HexUUID | None = None
    user_username: str | None = None
    is_global: bool | None = None
    delivery: Delivery | None = None
    descending: bool = False
