from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.broker.management import QueueInfo
from queuekeeper.common.schemas import Schema, UTCDateTime
from queuekeeper.models import GivenUpDeadLetter


class DeadLetterQueueOut(BaseModel):
    vhost: str
    queue: str
    present: bool
    messages: int | None = Field(
        description="Ready plus unacknowledged, as of the broker's last statistics tick (null "
        "for a few seconds after the queue was created)."
    )
    messages_ready: int | None = None
    messages_unacknowledged: int | None = None

    @classmethod
    def from_info(cls, vhost: str, queue: str, info: QueueInfo | None) -> DeadLetterQueueOut:
        return cls(
            vhost=vhost,
            queue=queue,
            present=info is not None,
            messages=info.messages if info else None,
            messages_ready=info.messages_ready if info else None,
            messages_unacknowledged=info.messages_unacknowledged if info else None,
        )


class GivenUpOut(Schema):
    id: int
    vhost: str
    original_queue: str | None
    reason: str = Field(
        description="`too_old`, `too_many_redrives`, `queue_gone` or `no_origin`, then details."
    )
    death_count: int = Field(description="Times it was dead-lettered (sum of `x-death` counts).")
    first_death_at: UTCDateTime | None
    message_id: str | None
    body_size: int
    recorded: UTCDateTime

    @classmethod
    def from_row(cls, record: GivenUpDeadLetter) -> GivenUpOut:
        return cls.model_validate(record)


class DeadLettersOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "total_messages": 3,
                    "vhosts": [
                        {
                            "vhost": "8a1b…",
                            "queue": "waldur.dlq.messages",
                            "present": True,
                            "messages": 3,
                            "messages_ready": 3,
                            "messages_unacknowledged": 0,
                        }
                    ],
                    "given_up_total": 1,
                    "given_up": [
                        {
                            "id": 7,
                            "vhost": "8a1b…",
                            "original_queue": "subscription_0f6c…_offering_5f0c…_order",
                            "reason": "too_old: published 2026-11-20T10:00:00+00:00, older "
                            "than 86400 s",
                            "death_count": 1,
                            "first_death_at": "2026-11-20T11:00:00Z",
                            "message_id": "evt-123",
                            "body_size": 245,
                            "recorded": "2026-11-22T06:00:01Z",
                        }
                    ],
                }
            ]
        }
    )

    total_messages: int = Field(description="Sum over the vhosts whose count is known.")
    vhosts: list[DeadLetterQueueOut]
    given_up_total: int
    given_up: list[GivenUpOut] = Field(description="Newest first, paginated by page/page_size.")
