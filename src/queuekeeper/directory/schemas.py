from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.schemas import HexUUID, InputDateTime, Schema, UTCDateTime
from queuekeeper.common.urls import api_url
from queuekeeper.config import Settings
from queuekeeper.models import Customer, Offering, OfferingAccess, Project, Role, User


class UserPut(BaseModel):
    """Fields left out keep their stored value; `token: null` removes the token."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "username": "site-agent-a",
                    "full_name": "Site agent A",
                    "email": "ops@example.org",
                    "token": "2f6c1e0b9d0a4c53a5e4c1f2b3a4d5e6f7a8b9c0",
                    "token_expires_at": None,
                    "is_active": True,
                }
            ]
        },
    )

    username: str = Field(min_length=1, max_length=255)
    full_name: str | None = Field(default=None, max_length=255)
    email: str | None = Field(default=None, max_length=320)
    token: str | None = Field(default=None, min_length=8, max_length=512)
    token_expires_at: InputDateTime | None = None
    is_active: bool | None = None
    is_staff: bool = Field(
        default=False,
        description="Staff may bind other users and register global consumers. False when "
        "absent, as the backend pushes the whole user.",
    )
    is_support: bool = Field(default=False, description="As `is_staff`, for support users.")


class UserOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "8b1a9953c4611296a827abf8c47804d7",
                    "url": "https://queuekeeper.example.org/api/users/8b1a9953c4611296a827abf8c47804d7/",
                    "username": "site-agent-a",
                    "full_name": "Site agent A",
                    "email": "ops@example.org",
                    "is_active": True,
                    "is_staff": False,
                    "is_support": False,
                    "has_token": True,
                    "token_expires_at": None,
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    url: str
    username: str
    full_name: str
    email: str
    is_active: bool
    is_staff: bool
    is_support: bool
    has_token: bool
    token_expires_at: UTCDateTime | None
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, user: User, settings: Settings) -> UserOut:
        return cls(
            uuid=user.uuid,
            url=api_url(settings, "users", user.uuid),
            username=user.username,
            full_name=user.full_name,
            email=user.email,
            is_active=user.is_active,
            is_staff=user.is_staff,
            is_support=user.is_support,
            has_token=user.token_hash is not None,
            token_expires_at=user.token_expires_at,
            created=user.created,
            modified=user.modified,
        )


class OfferingPut(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "name": "HPC cluster",
                    "state": "Active",
                    "customer_uuid": "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6",
                }
            ]
        },
    )

    name: str = Field(min_length=1, max_length=255)
    state: str | None = Field(default=None, max_length=64)
    customer_uuid: uuid.UUID | None = Field(
        default=None, description="The provider's customer (pushed first); null: none."
    )
    project_uuid: uuid.UUID | None = Field(
        default=None, description="The offering's project (pushed first); null: none."
    )


class OfferingOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "name": "HPC cluster",
                    "state": "Active",
                    "customer_uuid": "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6",
                    "project_uuid": None,
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    name: str
    state: str
    customer_uuid: HexUUID | None
    project_uuid: HexUUID | None
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, offering: Offering) -> OfferingOut:
        return cls.model_validate(offering)


class CustomerPut(BaseModel):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"name": "University of Tartu"}]}
    )

    name: str = Field(min_length=1, max_length=255)


class CustomerOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6",
                    "name": "University of Tartu",
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    name: str
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, customer: Customer) -> CustomerOut:
        return cls.model_validate(customer)


class ProjectPut(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {"name": "Climate models", "customer_uuid": "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6"}
            ]
        },
    )

    name: str = Field(min_length=1, max_length=255)
    customer_uuid: uuid.UUID = Field(description="Its customer (pushed first).")


class ProjectOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "9d0a4c4c53a5e4c1f2b3a4d5e63c1e0b",
                    "name": "Climate models",
                    "customer_uuid": "3c1e0b9d0a4c4c53a5e4c1f2b3a4d5e6",
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    name: str
    customer_uuid: HexUUID
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, project: Project) -> ProjectOut:
        return cls.model_validate(project)


class RoleScopeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["customer", "project", "offering"]
    uuid: uuid.UUID


class RolePut(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "user_uuid": "8b1a9953c4611296a827abf8c47804d7",
                    "role_name": "PROJECT.MANAGER",
                    "scope": {"type": "project", "uuid": "9d0a4c4c53a5e4c1f2b3a4d5e63c1e0b"},
                    "expires_at": None,
                }
            ]
        },
    )

    user_uuid: uuid.UUID
    role_name: str = Field(min_length=1, max_length=128)
    scope: RoleScopeIn
    expires_at: InputDateTime | None = Field(
        default=None, description="When the role stops counting; null: never."
    )


class RoleOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "1f2b3a4d5e63c1e0b9d0a4c4c53a5e4c",
                    "user_uuid": "8b1a9953c4611296a827abf8c47804d7",
                    "role_name": "PROJECT.MANAGER",
                    "scope": {"type": "project", "uuid": "9d0a4c4c53a5e4c1f2b3a4d5e63c1e0b"},
                    "expires_at": None,
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    user_uuid: HexUUID
    role_name: str
    scope: dict[str, str]
    expires_at: UTCDateTime | None
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, role: Role) -> RoleOut:
        return cls(
            uuid=role.uuid,
            user_uuid=role.user_uuid,
            role_name=role.role_name,
            scope={"type": role.scope_type, "uuid": role.scope_uuid.hex},
            expires_at=role.expires_at,
            created=role.created,
            modified=role.modified,
        )


class AccessOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "user_uuid": "8b1a9953c4611296a827abf8c47804d7",
                    "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "created": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    user_uuid: HexUUID
    offering_uuid: HexUUID
    created: UTCDateTime

    @classmethod
    def from_row(cls, grant: OfferingAccess) -> AccessOut:
        return cls.model_validate(grant)


# --- bulk import (`queuekeeper import-directory FILE`) -------------------------------


class ImportUser(UserPut):
    uuid: uuid.UUID


class ImportOffering(OfferingPut):
    uuid: uuid.UUID


class ImportGrant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_uuid: uuid.UUID
    offering_uuid: uuid.UUID


class DirectoryFile(BaseModel):
    """What `queuekeeper import-directory` reads: the same fields as the internal PUTs."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "offerings": [
                        {"uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b", "name": "HPC cluster"}
                    ],
                    "users": [
                        {
                            "uuid": "8b1a9953c4611296a827abf8c47804d7",
                            "username": "site-agent-a",
                            "token": "2f6c1e0b9d0a4c53a5e4c1f2b3a4d5e6f7a8b9c0",
                        }
                    ],
                    "grants": [
                        {
                            "user_uuid": "8b1a9953c4611296a827abf8c47804d7",
                            "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                        }
                    ],
                }
            ]
        },
    )

    offerings: list[ImportOffering] = Field(default_factory=list)
    users: list[ImportUser] = Field(default_factory=list)
    grants: list[ImportGrant] = Field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.offerings) + len(self.users) + len(self.grants)
