"""How queuekeeper opens AMQP connections: one URL per vhost, one TLS set-up, several nodes.

Used by the publisher pool, the dead-letter redrive and the readiness check.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection

from queuekeeper.broker.nodes import NodeList, node_label
from queuekeeper.config import Settings

# What a connection attempt raises when the node is down or hangs (aio-pika's "closed"
# errors are RuntimeErrors).
CONNECT_ERRORS = (aiormq.exceptions.AMQPError, RuntimeError, OSError, TimeoutError)


def vhost_url(amqp_url: str, vhost: str) -> str:
    """The configured AMQP URL pointed at `vhost`; its query (heartbeat, TLS options) is kept."""
    parts = urlsplit(amqp_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(vhost, safe=""), parts.query, ""))


def amqp_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """None for plain `amqp://`; for `amqps://`, checks on unless switched off explicitly."""
    if urlsplit(settings.amqp_urls[0]).scheme != "amqps":  # one scheme for all nodes
        return None
    context = ssl.create_default_context(cafile=settings.tls_ca_file)
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if not settings.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def amqp_nodes(settings: Settings) -> NodeList:
    return NodeList("amqp", settings.amqp_urls, settings.broker_node_retry_seconds)


def vhost_refused(exc: BaseException) -> bool:
    """The broker closed the connection at `connection.open`: the vhost is missing or we
    have no permissions in it (RabbitMQ answers 530 NOT_ALLOWED; aiormq reports the Close
    frame it got instead of OpenOk). Every node of a cluster would say the same."""
    if isinstance(exc, aiormq.exceptions.ConnectionNotAllowed):
        return True
    return isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.OpenOk" in str(exc)


def connection_lost(exc: BaseException) -> bool:
    """No AMQP connection to a node, or it went: nothing to do in the vhost until one is back."""
    return isinstance(exc, aiormq.exceptions.AMQPConnectionError)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class BrokerUnreachable(aiormq.exceptions.AMQPConnectionError):
    """No node took the connection: names each node tried with what it answered, whatever
    the error's own words say (asyncio's loop names the address, "Connect call failed
    ('host', port)"; uvloop, which `serve` runs on, does not: "[Errno 111] Connection
    refused"). The last node's error is its cause."""

    def __str__(self) -> str:
        return str(self.args[0])


async def connect_vhost(
    nodes: NodeList,
    vhost: str,
    *,
    connect_timeout: float,
    ssl_context: ssl.SSLContext | None,
    **options: Any,
) -> tuple[AbstractConnection, str]:
    """A plain (not robust) connection to `vhost` on the first node that takes it.

    Returns the connection and the node URL it went to. A refused vhost is raised at once
    (it is refused cluster-wide); any other failure moves on to the next node, and the
    last failure is raised when none took it.
    """
    last: BaseException | None = None
    failures: list[str] = []
    for node in nodes.order():
        try:
            connection = await aio_pika.connect(
                vhost_url(node, vhost), timeout=connect_timeout, ssl_context=ssl_context, **options
            )
        except CONNECT_ERRORS as exc:
            if vhost_refused(exc):
                nodes.answered(node)
                raise
            nodes.failed(node, describe(exc))
            failures.append(f"{node_label(node)}: {describe(exc)}")
            last = exc
            continue
        nodes.answered(node)
        return connection, node
    assert last is not None  # NodeList is never empty
    raise BrokerUnreachable("; ".join(failures)) from last
