"""The `url` fields of responses: absolute, under QUEUEKEEPER_PUBLIC_URL, with a trailing slash."""

from __future__ import annotations

import uuid

from queuekeeper.config import Settings


def api_url(settings: Settings, collection: str, item: uuid.UUID | None = None) -> str:
    base = settings.public_url.rstrip("/")
    return f"{base}/api/{collection}/" + (f"{item.hex}/" if item else "")
