"""A real STOMP-over-WebSocket consumer (stomp.py, the site agent's library) for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import stomp

from tests.brokers import BROKER

WEB_STOMP = BROKER.web_stomp


@dataclass
class Received:
    headers: dict[str, str]
    body: str


@dataclass
class _Listener(stomp.ConnectionListener):  # type: ignore[misc]
    messages: list[Received] = field(default_factory=list)
    errors: list[Received] = field(default_factory=list)
    disconnects: int = 0
    event: threading.Event = field(default_factory=threading.Event)

    def on_message(self, frame: Any) -> None:
        self.messages.append(Received(dict(frame.headers), frame.body))
        self.event.set()

    def on_error(self, frame: Any) -> None:
        self.errors.append(Received(dict(frame.headers), frame.body))
        self.event.set()

    def on_disconnected(self) -> None:
        self.disconnects += 1
        self.event.set()


class StompConsumer:
    """Logs in the way waldur-site-agent does: login = subscription hex, passcode = token,
    host (vhost) = owner hex; subscribes to `/amq/queue/<name>` with ack:auto."""

    def __init__(self, vhost: str, login: str, passcode: str) -> None:
        self.listener = _Listener()
        self.connection = stomp.WSStompConnection(
            host_and_ports=[WEB_STOMP],
            ws_path="/ws",
            vhost=vhost,
            reconnect_attempts_max=1,
            heartbeats=(0, 0),
        )
        self.connection.set_listener("test", self.listener)
        self.login = login
        self.passcode = passcode

    def connect(self) -> None:
        self.connection.connect(self.login, self.passcode, wait=True, with_connect_command=False)

    def subscribe(
        self, destination: str, sub_id: str = "1", ack: str = "auto", prefetch: int | None = None
    ) -> None:
        """`ack="client-individual"` with a `prefetch` leaves what it received unacked (the
        broker sends no more than `prefetch` until they are acked)."""
        headers = {"prefetch-count": str(prefetch)} if prefetch is not None else {}
        self.connection.subscribe(destination=destination, id=sub_id, ack=ack, headers=headers)

    def wait_for(self, count: int = 1, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.listener.messages) < count and time.monotonic() < deadline:
            self.listener.event.wait(0.05)
            self.listener.event.clear()
        return list(self.listener.messages)

    def wait_for_ids(self, ids: Collection[str], timeout: float = 10.0) -> list[Received]:
        """Until every `amqp-message-id` in `ids` has arrived: after a crash a copy may come
        twice (at-least-once), so a count of messages can be reached with one still on its
        way."""
        deadline = time.monotonic() + timeout
        wanted = set(ids)
        while time.monotonic() < deadline:
            seen = {m.headers.get("amqp-message-id") for m in self.listener.messages}
            if wanted <= seen:
                break
            self.listener.event.wait(0.05)
            self.listener.event.clear()
        return list(self.listener.messages)

    def wait_refused(self, timeout: float = 5.0) -> bool:
        """True once the broker sent ERROR or dropped the connection."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.listener.errors
                or self.listener.disconnects
                or not self.connection.is_connected()
            ):
                return True
            self.listener.event.wait(0.05)
            self.listener.event.clear()
        return False

    def close(self) -> None:
        try:
            if self.connection.is_connected():
                self.connection.disconnect()
        except Exception:
            pass
