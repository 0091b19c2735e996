"""Standard Webhooks signing (contract §13); the secret's form (`whsec_` + base64 of the key).

The signature is `v1,` + base64 of HMAC-SHA256 over `"{id}.{timestamp}.{body}"`, keyed with
the bytes the secret encodes after `whsec_`: three lines of the standard library, so it is
written here rather than taken from the `standardwebhooks` package (a generated API client
with its own dependencies), which the tests use to verify what is sent
(docs/decisions/026-webhooks-on-the-outbox.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence

# Standard Webhooks' secrets: `whsec_` + base64 of the key.
SECRET_PREFIX = "whsec_"


def secret_key(secret: str) -> bytes:
    """The key a `whsec_` secret encodes (a secret without the prefix is taken as base64)."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    return base64.b64decode(encoded)


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for this message."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(
    secrets: str | Sequence[str], message_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt: signed with each secret, in order and
    space-separated (while a rotation's window lasts, the new one and the previous one,
    contract §14; a receiver accepts the message when any signature matches its secret)."""
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(
            signature(secret, message_id, timestamp, body) for secret in keys
        ),
    }
