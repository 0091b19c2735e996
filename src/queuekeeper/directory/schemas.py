from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime


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
    token_expires_at: datetime | None = None
    is_active: bool | None = None


class UserOut(Schema):
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


class OfferingPut(BaseModel):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"name": "HPC cluster", "state": "Active"}]}
    )

    name: str = Field(min_length=1, max_length=255)
    state: str | None = Field(default=None, max_length=64)


class OfferingOut(Schema):
    uuid: HexUUID
    name: str
    state: str
    created: UTCDateTime
    modified: UTCDateTime


class AccessOut(Schema):
    user_uuid: HexUUID
    offering_uuid: HexUUID
    created: UTCDateTime
