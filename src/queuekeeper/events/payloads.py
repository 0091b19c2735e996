"""Object types and their payload models: adding a type is one entry in PAYLOAD_MODELS.

Required fields are what the published agents (waldur-site-agent 1.0.5, 1.0.7 and
1.0.8) read; every model keeps extra fields, since the backend sends more than the
agent needs. The table holds every value of waldur-api-client 8.1.3's
`ObservableObjectTypeEnum` (18), so each is accepted as an event type, in a consumer's
filter and in register_event_subscription; the ones no published agent handles carry
no required fields (the agents log and drop them).
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
            # The agents look the user up by this name: an empty one matches nobody.
            missing = [] if self.user_username else ["a non-empty user_username"]
            if self.granted is None:
                missing.append("granted")
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


# The commands of agent 1.0.8's resource_api_keys (Waldur's ResourceApiKeyActions).
API_KEY_ACTIONS = ("create", "rotate", "pause", "resume", "update", "delete")
# Agent 1.0.7's only other word, from Mastermind's docs; no published agent acts on it
# (1.0.7 and 1.0.8 log it as unknown). Still accepted so a backend that sends it is not
# refused after an upgrade (docs/reference/site-agent-1.0.8.md, "Payloads 1.0.8 reads").
DEPRECATED_API_KEY_ACTIONS = ("revoke",)


class ResourceApiKeyRotationPayload(Payload):
    """A command about one resource API key, as agent 1.0.8's `ApiKeyCommand` reads it."""

    action: Literal["create", "rotate", "pause", "resume", "update", "delete", "revoke"]
    resource_uuid: UUIDText
    api_key_uuid: UUIDText
    resource_backend_id: str | None = None
    client_id: str | None = None
    limits: dict[str, Any] | None = None
    allowed_models: list[Any] | None = None
    spending_limits: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _command_fields(self) -> ResourceApiKeyRotationPayload:
        if self.action in DEPRECATED_API_KEY_ACTIONS:
            return self  # as accepted before 1.0.8: resource_uuid and api_key_uuid
        # The agent drops a command without a backend id, and every command but create
        # acts on the key's client_id (a delete without one: a key that never reached the
        # backend, which the agent settles without touching it).
        missing = [] if self.resource_backend_id else ["resource_backend_id"]
        if not self.client_id and self.action not in ("create", "delete"):
            missing.append("client_id")
        if missing:
            raise ValueError(f"{' and '.join(missing)} required when action is {self.action}")
        return self


ProjectGroupAction = Literal["create", "update", "delete", "switch"]


class ServiceProviderProjectGroupPayload(Payload):
    """A provider's POSIX project group changed (agent 1.0.8's `ProjectGroupMessage`).

    The agent reads `action`, `name` and `gid` and then re-reads the provider's groups;
    Waldur adds `service_provider_uuid` and `customer_uuid` to every message
    (marketplace/project_groups.py). Sent to every offering of the provider at once with
    the events API's `offering_uuids`.
    """

    action: ProjectGroupAction
    service_provider_uuid: UUIDText
    customer_uuid: UUIDText
    project_group_uuid: UUIDText | None = None
    project_uuid: UUIDText | None = None
    name: str | None = None
    gid: int | None = None
    changed_fields: list[str] | None = None
    project_groups_enabled: bool | None = None

    @model_validator(mode="after")
    def _action_fields(self) -> ServiceProviderProjectGroupPayload:
        if self.action == "switch":
            if self.project_groups_enabled is None:
                raise ValueError("project_groups_enabled required when action is switch")
        elif self.project_group_uuid is None:
            raise ValueError(f"project_group_uuid required when action is {self.action}")
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
    "service_provider_project_group": ServiceProviderProjectGroupPayload,
    # In client 8.1.3's enum; no published agent handles these yet.
    "call": Payload,
    "proposal": Payload,
    "resource_end_date_change_request": Payload,
    "service_provider_account": Payload,
    "user_lifecycle": Payload,
    "user_profile": Payload,
    "user_ssh_key": Payload,
}

OBJECT_TYPES: tuple[str, ...] = tuple(PAYLOAD_MODELS)
# Events about a user rather than an offering (contract §12): sent with
# `subject_user_uuid`, `offering_uuid` optional.
IDENTITY_TYPES = frozenset({"user_role", "user_profile", "user_ssh_key", "user_lifecycle"})


def _known_object_type(value: str) -> str:
    if value not in PAYLOAD_MODELS:
        raise ValueError(f"unknown object type {value!r}; known types: {', '.join(OBJECT_TYPES)}")
    return value


ObjectType = Annotated[
    str,
    AfterValidator(_known_object_type),
    Field(json_schema_extra={"enum": list(OBJECT_TYPES), "examples": ["order"]}),
]
