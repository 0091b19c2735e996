from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.schemas import HexUUID, InputDateTime, Schema, UTCDateTime
from queuekeeper.common.urls import api_url
from queuekeeper.config import Settings
from queuekeeper.models import Offering, OfferingAccess, User


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
            has_token=user.token_hash is not None,
            token_expires_at=user.token_expires_at,
            created=user.created,
            modified=user.modified,
        )


class OfferingPut(BaseModel):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"name": "HPC cluster", "state": "Active"}]}
    )

    name: str = Field(min_length=1, max_length=255)
    state: str | None = Field(default=None, max_length=64)


class OfferingOut(Schema):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "name": "HPC cluster",
                    "state": "Active",
                    "created": "2024-05-01T12:00:00.123456Z",
                    "modified": "2024-05-01T12:00:00.123456Z",
                }
            ]
        }
    )

    uuid: HexUUID
    name: str
    state: str
    created: UTCDateTime
    modified: UTCDateTime

    @classmethod
    def from_row(cls, offering: Offering) -> OfferingOut:
        return cls.model_validate(offering)


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
