"""Object types and their payload models: adding a type is one entry in PAYLOAD_MODELS.

Required fields are what the reference agents (waldur-site-agent 1.0.5 and 1.0.7)
read; every model keeps extra fields, since the backend sends more than the agent
needs. The table holds every type of waldur-api-client 8.1.2's
`ObservableObjectTypeEnum`, so each is accepted as an event type and as a
consumer's filter value; the four that no published agent handles yet carry no
required fields (1.0.7 logs and drops them).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _uuid_text(value: str) -> str:
    uuid.UUID(value)  # raises ValueError with pydantic's "Value error" message
    return value


# Kept as sent (the agent reads these strings), but must parse as a uuid.
UUIDText = Annotated[str, AfterValidator(_uuid_text), Field(json_schema_extra={"format": "uuid"})]


class Payload(BaseModel):
    model_config = ConfigDict(extra="allow")


# Waldur's order states as its REST API writes them, hyphenated: the 1.0.7 agent skips an
# order early by comparing `order_state` with these exact strings ("pending-consumer"),
# so a spelling such as "pending consumer" would slip past that check.
OrderState = Literal[
    "pending-consumer",
    "pending-provider",
    "pending-project",
    "pending-start-date",
    "executing",
    "done",
    "erred",
    "canceled",
    "rejected",
]


class OrderPayload(Payload):
    order_uuid: UUIDText
    order_state: OrderState | None = None
    action: str | None = None


class UserRolePayload(Payload):
    project_uuid: UUIDText
    project_name: str
    user_uuid: UUIDText | None = None
    user_username: str | None = None
    granted: bool | None = None
    # 1.0.7: without user_uuid, a resource_uuid asks for a resync of that resource's users.
    resource_uuid: UUIDText | None = None

    @model_validator(mode="after")
    def _user_fields(self) -> UserRolePayload:
        if self.user_uuid is not None:
            missing = [name for name in ("user_username", "granted") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"{' and '.join(missing)} required when user_uuid is set")
        return self


class ResourcePayload(Payload):
    resource_uuid: UUIDText


class ResourcePeriodicLimitsPayload(Payload):
    resource_uuid: UUIDText
    backend_id: str
    action: Literal["apply_periodic_settings"]
    settings: dict[str, Any]


class OfferingUserPayload(Payload):
    offering_user_uuid: UUIDText
    action: Literal["create", "update", "delete", "attribute_update", "username_set"]


class AccountPayload(Payload):
    account_uuid: UUIDText
    account_username: str
    project_uuid: UUIDText
    action: Literal["create", "delete"]


class ImportableResourcesPayload(Payload):
    backend_resource_request_uuid: UUIDText


class ResourceApiKeyRotationPayload(Payload):
    action: Literal["rotate", "revoke"]
    resource_uuid: UUIDText
    api_key_uuid: UUIDText
    resource_backend_id: str | None = None
    client_id: str | None = None

    @model_validator(mode="after")
    def _rotate_fields(self) -> ResourceApiKeyRotationPayload:
        # The 1.0.7 agent refuses (and loses) a rotation without both.
        if self.action == "rotate":
            missing = [
                name for name in ("resource_backend_id", "client_id") if not getattr(self, name)
            ]
            if missing:
                raise ValueError(f"{' and '.join(missing)} required when action is rotate")
        return self


class OfferingResourcesSyncPayload(Payload):
    pass


PAYLOAD_MODELS: dict[str, type[Payload]] = {
    "order": OrderPayload,
    "user_role": UserRolePayload,
    "resource": ResourcePayload,
    "resource_periodic_limits": ResourcePeriodicLimitsPayload,
    "offering_user": OfferingUserPayload,
    "service_account": AccountPayload,
    "course_account": AccountPayload,
    "importable_resources": ImportableResourcesPayload,
    "resource_api_key_rotation": ResourceApiKeyRotationPayload,
    "offering_resources_sync": OfferingResourcesSyncPayload,
    # In client 8.1.2's enum; no published agent handles these yet.
    "resource_end_date_change_request": Payload,
    "user_lifecycle": Payload,
    "user_profile": Payload,
    "user_ssh_key": Payload,
}

OBJECT_TYPES: tuple[str, ...] = tuple(PAYLOAD_MODELS)


def _known_object_type(value: str) -> str:
    if value not in PAYLOAD_MODELS:
        raise ValueError(f"unknown object type {value!r}; known types: {', '.join(OBJECT_TYPES)}")
    return value


ObjectType = Annotated[
    str,
    AfterValidator(_known_object_type),
    Field(json_schema_extra={"enum": list(OBJECT_TYPES), "examples": ["order"]}),
]
