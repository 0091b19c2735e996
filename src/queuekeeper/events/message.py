"""What every delivery of a copy carries, by queue or by webhook: the message body and the
ids that name who took it.

The relay (events/relay.py) publishes this body to a queue and the webhook dispatcher
(webhooks/dispatcher.py) posts it, signed; both are the same message (contract §9, §13),
so it is written once, here.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import uuid
from typing import Protocol

# What every consumer's copy says it is (contract §9); recipients.py decides a payload filter
# on it once, when the consumer is read.
CONSUMER_SCHEMA_VERSION = 1


class Stored(Protocol):
    """What the body is made from: a claimed copy (`outbox.Claimed`). A protocol, so the
    recipients (which outbox.py imports) may take `CONSUMER_SCHEMA_VERSION` from here."""

    @property
    def body(self) -> str: ...
    @property
    def consumer_uuid(self) -> uuid.UUID | None: ...
    @property
    def copy_offering_uuid(self) -> uuid.UUID | None: ...


def new_relay_id() -> str:
    """The id a relay or a dispatcher claims copies under (host, process, random): the
    lease's holder, unique across replicas and restarts."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{secrets.token_hex(3)}"


def message_body(item: Stored) -> bytes:
    """The stored body; a consumer's copy also says `schema_version: 1` (contract §9), and a
    fan-out's copy the offering of its own queue (contract §10)."""
    if item.consumer_uuid is None and item.copy_offering_uuid is None:
        return item.body.encode()
    body = json.loads(item.body)
    if item.consumer_uuid is not None:
        body["schema_version"] = CONSUMER_SCHEMA_VERSION
    if item.copy_offering_uuid is not None:
        body["offering_uuid"] = item.copy_offering_uuid.hex
    return json.dumps(body, separators=(",", ":")).encode()
