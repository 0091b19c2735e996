"""How queuekeeper opens AMQP connections: one URL per vhost, one TLS set-up.

Used by the publisher pool, the dead-letter redrive and the readiness check.
"""

from __future__ import annotations

import ssl
from urllib.parse import quote, urlsplit, urlunsplit

from queuekeeper.config import Settings


def vhost_url(amqp_url: str, vhost: str) -> str:
    """The configured AMQP URL pointed at `vhost`; its query (heartbeat, TLS options) is kept."""
    parts = urlsplit(amqp_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(vhost, safe=""), parts.query, ""))


def amqp_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """None for plain `amqp://`; for `amqps://`, checks on unless switched off explicitly."""
    if urlsplit(settings.amqp_url).scheme != "amqps":
        return None
    context = ssl.create_default_context(cafile=settings.tls_ca_file)
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if not settings.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
