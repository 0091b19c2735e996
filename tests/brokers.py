"""Where the test suite finds RabbitMQ: every test reads the addresses from here (or from
the `broker` fixture, which hands out the same object), so pointing the suite at another
broker is one set of environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True)
class BrokerAddresses:
    host: str
    amqp_port: int
    management_port: int
    web_stomp_port: int
    stomp_port: int
    user: str = "guest"
    password: str = "guest"

    @classmethod
    def from_env(cls) -> BrokerAddresses:
        env = os.environ.get
        return cls(
            host=env("QK_TEST_RABBIT_HOST", "127.0.0.1"),
            amqp_port=int(env("QK_TEST_AMQP_PORT", "5672")),
            management_port=int(env("QK_TEST_MANAGEMENT_PORT", "15672")),
            web_stomp_port=int(env("QK_TEST_WEB_STOMP_PORT", "15674")),
            stomp_port=int(env("QK_TEST_STOMP_PORT", "61613")),
        )

    def amqp_url(
        self, vhost: str = "/", *, user: str | None = None, password: str | None = None
    ) -> str:
        """An administrator's (or the given user's) AMQP URL for `vhost`."""
        login = f"{quote(user or self.user, safe='')}:{quote(password or self.password, safe='')}"
        path = "" if vhost == "/" else quote(vhost, safe="")
        return f"amqp://{login}@{self.host}:{self.amqp_port}/{path}"

    @property
    def management_url(self) -> str:
        return f"http://{self.host}:{self.management_port}"

    @property
    def web_stomp(self) -> tuple[str, int]:
        return (self.host, self.web_stomp_port)


BROKER = BrokerAddresses.from_env()
