"""A webhook consumer's URL and secret at registration (contract §13;
docs/decisions/027-webhook-registration.md).

The URL may carry a credential (in its query or user info), so it is a secret: it is
stored as given and never returned or logged; answers and logs show its destination (scheme,
host and port: `common/urls.py`'s `destination`, which every consumer's answer uses). A
refusal names the field and the reason without repeating the URL.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit

import httpx

from queuekeeper.common.urls import DEFAULT_PORTS
from queuekeeper.exceptions import BadRequest
from queuekeeper.webhooks.addresses import AddressRefused, IPNetwork, resolve
from queuekeeper.webhooks.signing import SECRET_PREFIX

# Longer URLs are refused: browsers and proxies commonly stop near 2,000 characters, and
# nothing a receiver needs comes close.
MAX_URL_LENGTH = 2048
# Standard Webhooks' secrets (`signing.SECRET_PREFIX` + base64 of the key): 24 bytes is its
# minimum.
SECRET_BYTES = 32
FIELD = "webhook_url"


def _refuse(reason: str) -> BadRequest:
    return BadRequest(f"`webhook_url` {reason}.", field=FIELD)


def parsed(url: str) -> SplitResult:
    """The URL split, or a BadRequest naming `webhook_url` and what is wrong with it (the
    checks that need no network)."""
    if len(url) > MAX_URL_LENGTH:
        raise _refuse(f"is longer than {MAX_URL_LENGTH} characters ({len(url)})")
    if any(ch.isspace() or ord(ch) < 0x20 for ch in url):
        raise _refuse("holds whitespace or control characters")
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError as exc:
        raise _refuse(f"is not a valid URL ({exc})") from None
    if split.scheme.lower() not in DEFAULT_PORTS:
        shown = f"{split.scheme!r}" if split.scheme else "none"
        raise _refuse(f"must be an http or https URL (scheme: {shown})")
    if "#" in url:
        raise _refuse("has a fragment (`#...`), which is never sent to a server: remove it")
    if not split.hostname:
        raise _refuse("has no host")
    if port == 0:
        raise _refuse("has port 0")
    try:
        httpx.URL(url)  # what each attempt posts to: refused now, not at every attempt
    except httpx.InvalidURL as exc:
        raise _refuse(f"is not a valid URL ({exc})") from None
    return split


async def checked(url: str, allowed: Sequence[IPNetwork]) -> str:
    """`url` if a webhook may point at it now: well formed, and every address its host
    resolves to allowed by the address rule (webhooks/addresses.py); else a BadRequest
    naming `webhook_url` and the reason."""
    split = parsed(url)
    host = split.hostname or ""
    port = split.port or DEFAULT_PORTS[split.scheme.lower()]
    try:
        await resolve(host, port, allowed)
    except AddressRefused as refused:
        hint = (
            ""
            if "does not resolve" in refused.reason
            else " (QUEUEKEEPER_WEBHOOK_ALLOWED_NETWORKS lists the networks allowed besides "
            "public addresses)"
        )
        raise _refuse(f"may not be used: {refused.reason}{hint}") from None
    return url


def new_secret() -> str:
    """A signing secret: `whsec_` + base64 of SECRET_BYTES random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")
