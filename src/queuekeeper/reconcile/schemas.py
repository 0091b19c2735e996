from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.common.schemas import HexUUID


class QueueStateOut(BaseModel):
    """One queue as the database and the broker see it."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "queue_name": "subscription_0f6c…_offering_5f0c…_order",
                    "vhost": "8a1b…",
                    "state": "ok",
                    "registered": True,
                    "uuid": "c2d4e6f8a0b24c6e8f0a1b2c3d4e5f60",
                    "event_subscription_uuid": "0f6c2b1a9d8e4f7a6b5c4d3e2f1a0b9c",
                    "offering_uuid": "5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b",
                    "object_type": "order",
                    "present": True,
                    "arguments_ok": True,
                    "differences": [],
                    "messages": 0,
                    "consumers": 1,
                }
            ]
        }
    )

    queue_name: str
    vhost: str
    state: str = Field(
        description="`ok`; `missing` (registered, not on the broker); `drifted` (present with "
        "other arguments: see `differences`); `unregistered` (a `subscription_*` or "
        "`consumer_*` queue nothing registered); `foreign_vhost` (its vhost is not tagged as "
        "this installation's)."
    )
    registered: bool
    uuid: HexUUID | None = Field(default=None, description="The registration, when there is one.")
    event_subscription_uuid: HexUUID | None = None
    offering_uuid: HexUUID | None = None
    object_type: str | None = None
    consumer_uuid: HexUUID | None = Field(
        default=None,
        description="Set on a consumer's queue (`consumer_<hex>`, SPEC 9), which carries every "
        "type its filter holds; `uuid` is then the consumer's too.",
    )
    present: bool | None = Field(description="On the broker; null when its vhost is not ours.")
    arguments_ok: bool | None = Field(description="Null when not present.")
    differences: list[str] = Field(description="How the broker's queue differs from SPEC 3.")
    messages: int | None = Field(
        description="Ready plus unacknowledged, as of the broker's last statistics tick; null "
        "when not present or not yet known."
    )
    consumers: int | None = None
