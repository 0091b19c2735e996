"""Why a queue is silent (contract §11): the fields of the consumer status answer, which
every row of the admin queue view carries too."""

from __future__ import annotations

import enum
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from queuekeeper.broker.management import ConnectionInfo
from queuekeeper.common.schemas import HexUUID


class BlockedReason(enum.StrEnum):
    """Why events do not reach a queue's agent, in the order they are checked
    (presence/service.py `blocked_reason`): the first that holds is the answer."""

    OWNER_INACTIVE = "owner_inactive"
    TOKEN_EXPIRED = "token_expired"
    NO_TOKEN = "no_token"
    NO_ACCESS = "no_access"
    QUEUE_MISSING = "queue_missing"
    QUEUE_MISCONFIGURED = "queue_misconfigured"
    BROKER_USER_MISSING = "broker_user_missing"
    FILTER_MATCHES_NOTHING = "filter_matches_nothing"
    AGENT_AWAY = "agent_away"
    # A webhook consumer's (contract §13): its receiver answered 410, or its last attempt
    # failed.
    WEBHOOK_GONE = "webhook_gone"
    WEBHOOK_FAILING = "webhook_failing"


class ConnectionOut(BaseModel):
    peer_host: str | None
    peer_port: int | None
    connected_at: datetime | None
    client: str | None = Field(
        description="The client's product and version when it sent them, else the protocol "
        "(e.g. `Web STOMP 1.2`)."
    )

    @classmethod
    def from_info(cls, info: ConnectionInfo) -> ConnectionOut:
        return cls(
            peer_host=info.peer_host,
            peer_port=info.peer_port,
            connected_at=info.connected_at,
            client=info.client,
        )


REASONS_DESCRIPTION = (
    "Null when events flow; else, the first that holds of: `owner_inactive`, `token_expired`, "
    "`no_token` (the marketplace removed the owner's API token), `no_access` (to the "
    "offering), `queue_missing`, `queue_misconfigured`, `broker_user_missing`, "
    "`filter_matches_nothing`, `agent_away` (no consumer for longer than "
    "QUEUEKEEPER_PARK_AFTER_SECONDS: new copies are parked); for a webhook consumer, after "
    "the owner's and access reasons, `webhook_gone` (its receiver answered 410: update it to "
    "resume) or `webhook_failing` (its last attempt failed; it is retried)."
)


class QueueStatusFields(BaseModel):
    """Who reads the queue, what waits for it, and why nothing arrives (contract §11).
    Null where it could not be known (the queue or its vhost is not on the broker)."""

    connected: bool | None = Field(default=None, description="A consumer is attached now.")
    consumers: int | None = Field(
        default=None,
        description="Consumers attached now (from the broker's consumer events, within seconds).",
    )
    connections: list[ConnectionOut] = Field(
        default_factory=list,
        description="The connections its consumers came on, whenever `connected` is true "
        "(`connected_at` and `client` may be null in the seconds after a connect).",
    )
    away_since: datetime | None = Field(
        default=None,
        description="Since when it has had no consumer (its last one left, or queuekeeper first "
        "saw it without one); null while connected.",
    )
    ready: int | None = Field(
        default=None, description="Messages waiting in the queue now (null: no such queue)."
    )
    unacked: int | None = Field(
        default=None,
        description="Messages delivered to its consumer and not yet acknowledged, now.",
    )
    parked: int | None = Field(
        default=None, description="Copies held in the outbox while its agent is away."
    )
    oldest_parked_at: datetime | None = Field(
        default=None, description="When the oldest parked copy's event was accepted."
    )
    dead_letters: int | None = Field(
        default=None,
        description="Its messages in the vhost's dead-letter queue (expired or rejected) at "
        "`dead_letters_counted_at`: counted in the background at most every "
        "QUEUEKEEPER_DEAD_LETTER_CENSUS_SECONDS, never while you wait. Null until the vhost's "
        "first count.",
    )
    dead_letters_counted_at: datetime | None = Field(
        default=None,
        description="When `dead_letters` was counted; null until the vhost's first count "
        "(the next call a moment later has it).",
    )
    last_delivered_at: datetime | None = Field(
        default=None, description="When a copy for it was last confirmed by the broker."
    )
    delivery_blocked_reason: BlockedReason | None = Field(
        default=None, description=REASONS_DESCRIPTION
    )
    delivery_blocked_detail: str | None = Field(
        default=None, description="What is wrong and what to do about it, in a sentence."
    )


class QueueStatusOut(QueueStatusFields):
    """GET /api/event-consumers/{uuid}/status/; a webhook consumer's has no queue (its
    broker fields are null) and says what waits for its receiver."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "uuid": "0dc92ac0518e4604a2e27ff11120df6c",
                    "queue_name": "consumer_0dc92ac0518e4604a2e27ff11120df6c",
                    "vhost": "8b1a9953c4611296a827abf8c47804d7",
                    "connected": False,
                    "consumers": 0,
                    "connections": [],
                    "away_since": "2026-11-27T18:02:11Z",
                    "ready": 0,
                    "unacked": 0,
                    "parked": 412,
                    "oldest_parked_at": "2026-11-27T18:09:40Z",
                    "dead_letters": 0,
                    "dead_letters_counted_at": "2026-11-28T09:14:03Z",
                    "last_delivered_at": "2026-11-27T18:01:58Z",
                    "delivery_blocked_reason": "agent_away",
                    "delivery_blocked_detail": "No consumer has read this queue since "
                    "2026-11-27 18:02 UTC; new events are parked and arrive, in order, when "
                    "your agent subscribes again.",
                }
            ]
        },
    )

    uuid: HexUUID
    queue_name: str
    vhost: str
    pending: int | None = Field(
        default=None,
        description="A webhook consumer's copies waiting for its receiver (null for a queue).",
    )
    oldest_pending_at: datetime | None = Field(
        default=None, description="When the oldest of them was written (a webhook consumer)."
    )
    next_attempt_at: datetime | None = Field(
        default=None,
        description="When the next attempt to deliver one is due (a webhook consumer).",
    )
