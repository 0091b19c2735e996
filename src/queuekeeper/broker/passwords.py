"""RabbitMQ's `rabbit_password_hashing_sha256` format: base64(salt || sha256(salt || password))."""

from __future__ import annotations

import base64
import hashlib
import secrets

HASHING_ALGORITHM = "rabbit_password_hashing_sha256"


def rabbit_password_hash(password: str, salt: bytes | None = None) -> str:
    salt = secrets.token_bytes(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode("utf-8")).digest()
    return base64.b64encode(salt + digest).decode("ascii")


def rabbit_password_matches(password: str, password_hash: str) -> bool:
    raw = base64.b64decode(password_hash)
    return secrets.compare_digest(rabbit_password_hash(password, raw[:4]), password_hash)
