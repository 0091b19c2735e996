"""URLs in responses: the `url` fields (absolute, under QUEUEKEEPER_PUBLIC_URL, with a trailing
slash), and what an answer may show of a URL that can hold a credential (a webhook's,
docs/decisions/027-webhook-registration.md)."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

from queuekeeper.config import Settings

DEFAULT_PORTS = {"http": 80, "https": 443}


def api_url(settings: Settings, collection: str, item: uuid.UUID | None = None) -> str:
    base = settings.public_url.rstrip("/")
    return f"{base}/api/{collection}/" + (f"{item.hex}/" if item else "")


def destination(url: str) -> str:
    """What an answer shows of the URL: its scheme and host, and its port when it is not
    the scheme's default; never its path, query or credentials."""
    split = urlsplit(url)
    scheme = split.scheme.lower()
    host = split.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = split.port
    shown = f":{port}" if port is not None and port != DEFAULT_PORTS.get(scheme) else ""
    return f"{scheme}://{host}{shown}"
