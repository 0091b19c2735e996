"""Webhook consumers' bodies and answers (contract §13, §14), shaped as waldur-api-client
8.1.4's models: `EventConsumerWebhookRequest`, `EventConsumerWebhookUpdateRequest`, the
rotation's. What every consumer's answer holds is consumers/schemas.py's."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from queuekeeper.common.schemas import HexUUID, UTCDateTime
from queuekeeper.consumers.schemas import (
    MAX_PAYLOAD_FILTER_FIELDS,
    MAX_SCOPES,
    OBJECT_TYPES_DESCRIPTION,
    ConsumerFacts,
    ConsumerOut,
    ObjectTypes,
    PayloadFilters,
    ScopeIn,
    distinct_scopes,
    no_duplicates,
)
from queuekeeper.events.payloads import OBJECT_TYPES
from queuekeeper.models import EventConsumer

WEBHOOK_URL_DESCRIPTION = (
    "HTTP(S) URL the messages are POSTed to as JSON. It may carry a credential (in its query "
    "or user info): it is stored as a secret and never returned or logged; answers show "
    "`webhook_destination` (scheme, host and port). Refused (400) when it is not http or "
    "https, longer than 2,048 characters, has a fragment or no host, does not resolve, or "
    "its host is or resolves to a loopback, private, link-local, multicast, unspecified or "
    "reserved address outside QUEUEKEEPER_WEBHOOK_ALLOWED_NETWORKS."
)
SCOPES_DESCRIPTION = (
    "The entities whose events it receives, each at most once, as for "
    "/api/event-consumers/register/. `[]` (or omitted) means global: every event."
)


class WebhookRegistration(BaseModel):
    """`EventConsumerWebhookRequest` (client 8.1.4): a consumer that receives by HTTP. A
    field it does not know is a 400 naming it (contract §14): `webhook_secret` above all,
    which is never chosen by the caller (rotate_secret makes a new one)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "webhook_url": "https://hooks.example.org/waldur?key=s3cret",
                    "object_types": ["user_role"],
                    "scopes": [],
                    "payload_filters": {"scope_type": ["customer"]},
                }
            ]
        },
    )

    webhook_url: str = Field(description=WEBHOOK_URL_DESCRIPTION)
    payload_filters: PayloadFilters | None = Field(
        default=None,
        max_length=MAX_PAYLOAD_FILTER_FIELDS,
        description="`{field: [values]}`: a copy is made only when each listed top-level "
        "field of the message holds one of its values. Omitted or `{}`: no filter.",
    )
    object_types: ObjectTypes = Field(
        default=None, max_length=len(OBJECT_TYPES), description=OBJECT_TYPES_DESCRIPTION
    )
    scopes: list[ScopeIn] = Field(
        default_factory=list, max_length=MAX_SCOPES, description=SCOPES_DESCRIPTION
    )
    user_uuid: HexUUID | None = Field(
        default=None,
        description="With a service token only, and then required: the staff or support user "
        "who owns the consumer (whose access is checked for every event delivered). A user "
        "token registers for its own user.",
    )

    _unique = field_validator("object_types")(no_duplicates)
    _distinct = field_validator("scopes")(distinct_scopes)


class WebhookUpdate(BaseModel):
    """`EventConsumerWebhookUpdateRequest` (client 8.1.4), and `scopes`: omitted fields
    are left unchanged; a field it does not know (`webhook_secret` among them) is a 400
    naming it (contract §14)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"webhook_url": "https://hooks.example.org/v2"}]},
    )

    webhook_url: str | None = Field(default=None, description=WEBHOOK_URL_DESCRIPTION)
    payload_filters: PayloadFilters | None = Field(
        default=None,
        max_length=MAX_PAYLOAD_FILTER_FIELDS,
        description="Replaces the filters (`{}` removes them).",
    )
    object_types: ObjectTypes = Field(
        default=None, max_length=len(OBJECT_TYPES), description=OBJECT_TYPES_DESCRIPTION
    )
    scopes: list[ScopeIn] | None = Field(
        default=None,
        max_length=MAX_SCOPES,
        description=SCOPES_DESCRIPTION + " Copies not yet delivered that the new bindings "
        "no longer allow are given up.",
    )

    _unique = field_validator("object_types")(no_duplicates)
    _distinct = field_validator("scopes")(distinct_scopes)


# Rotating a webhook secret (contract §14): how long the previous one stays valid at most.
MAX_PREVIOUS_VALID_SECONDS = 604800


class RotateSecret(BaseModel):
    """`POST /api/event-consumers/{uuid}/rotate_secret/`."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"previous_valid_seconds": 3600}]}
    )

    previous_valid_seconds: int = Field(
        default=86400,
        ge=0,
        le=MAX_PREVIOUS_VALID_SECONDS,
        description="How long the previous secret still signs every delivery beside the new "
        "one (0: not at all). Default one day, at most seven.",
    )


class RotatedSecretOut(BaseModel):
    """The new signing secret, shown in this answer only."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "webhook_secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw/M1nJ4fmgqY=",
                    "previous_valid_until": "2026-12-08T07:00:00Z",
                }
            ]
        }
    )

    webhook_secret: str = Field(
        description="`whsec_` + base64 of the new signing key: shown in this answer only."
    )
    previous_valid_until: UTCDateTime | None = Field(
        description="Until when deliveries carry the previous secret's signature too (after "
        "the new one's); null when it ended at once."
    )


class WebhookConsumerOut(ConsumerOut):
    """The answer of register_webhook: `EventConsumer` and, this once, the signing secret."""

    webhook_secret: str = Field(
        description="`whsec_` + base64 of the signing key (Standard Webhooks): shown in this "
        "answer only; keep it to verify `webhook-signature`."
    )

    @classmethod
    def with_secret(
        cls, consumer: EventConsumer, facts: ConsumerFacts, *, as_staff: bool
    ) -> WebhookConsumerOut:
        answer = ConsumerOut.from_row(consumer, facts, as_staff=as_staff).model_dump()
        return cls(**answer, webhook_secret=consumer.webhook_secret or "")
