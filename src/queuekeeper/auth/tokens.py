"""Token digests: the clear token is never stored."""

from __future__ import annotations

import hashlib
import hmac


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def is_service_token(token: str, service_tokens: list[str]) -> bool:
    # Compare every configured token, so timing does not reveal which one matched.
    matched = False
    for candidate in service_tokens:
        matched |= hmac.compare_digest(token.encode("utf-8"), candidate.encode("utf-8"))
    return matched
