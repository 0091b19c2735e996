from __future__ import annotations

import enum

from pydantic import ConfigDict, Field, PrivateAttr

from queuekeeper.broker import topology
from queuekeeper.broker.management import QueueInfo
from queuekeeper.common.schemas import HexUUID
from queuekeeper.presence.schemas import QueueStatusFields
from queuekeeper.reconcile.repository import QueueRow


class QueueState(enum.StrEnum):
    OK = "ok"  # registered, present, arguments right
    MISSING = "missing"  # registered, not on the broker
    DRIFTED = "drifted"  # registered, present with other arguments
    UNREGISTERED = "unregistered"  # a `subscription_*` queue on the broker with no row
    FOREIGN_VHOST = "foreign_vhost"  # registered, but its vhost is not ours to look into


class QueueStateOut(QueueStatusFields):
    """One queue as the database and the broker see it, and (registered) why it is silent:
    the fields of `GET /api/event-consumers/{uuid}/status/` (contract §11)."""

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
                    "connected": True,
                    "connections": [
                        {
                            "peer_host": "192.0.2.10",
                            "peer_port": 51234,
                            "connected_at": "2026-11-27T08:00:01Z",
                            "client": "Web STOMP 1.2",
                        }
                    ],
                    "away_since": None,
                    "ready": 0,
                    "unacked": 0,
                    "parked": 0,
                    "oldest_parked_at": None,
                    "dead_letters": 0,
                    "last_delivered_at": "2026-11-27T09:12:40Z",
                    "delivery_blocked_reason": None,
                    "delivery_blocked_detail": None,
                }
            ]
        }
    )

    queue_name: str
    vhost: str
    state: QueueState = Field(
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
        description="Set on a consumer's queue (`consumer_<hex>`, contract §9), which carries "
        "every type its filter holds; `uuid` is then the consumer's too.",
    )
    present: bool | None = Field(description="On the broker; null when its vhost is not ours.")
    arguments_ok: bool | None = Field(description="Null when not present.")
    differences: list[str] = Field(description="How the broker's queue differs from contract §3.")
    messages: int | None = Field(
        description="Ready plus unacknowledged, as of the broker's last statistics tick; null "
        "when not present or not yet known."
    )
    # The broker's entry, for the status fields (`reconcile/view.py`); not in the answer.
    _broker: QueueInfo | None = PrivateAttr(default=None)

    @classmethod
    def from_row(
        cls,
        vhost: str,
        name: str,
        state: QueueState,
        row: QueueRow | None,
        broker: QueueInfo | None,
        differences: list[str],
    ) -> QueueStateOut:
        """A queue from its registration (if any) and the broker's entry (if listed).

        `present` and `arguments_ok` are null for a foreign vhost: nothing was asked there.
        """
        foreign = state is QueueState.FOREIGN_VHOST
        entry = cls(
            queue_name=name,
            vhost=vhost,
            state=state,
            registered=row is not None,
            uuid=row.uuid if row else None,
            event_subscription_uuid=row.subscription_uuid if row else None,
            offering_uuid=row.offering_uuid if row else None,
            object_type=row.object_type if row else None,
            consumer_uuid=row.uuid if row and row.consumer else topology.consumer_of(name),
            present=None if foreign else broker is not None,
            arguments_ok=(not differences) if broker is not None else None,
            differences=differences,
            messages=broker.messages if broker else None,
            consumers=broker.consumers if broker else None,
        )
        entry._broker = broker
        return entry

    @property
    def broker(self) -> QueueInfo | None:
        return self._broker
