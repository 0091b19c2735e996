"""Masking secrets: tokens, passwords, password hashes. Used by logs, `queuekeeper settings`
and readiness reports, so no secret reaches an operator's screen or a log store.

Three nets, each catching what the others cannot see:
- by key: a value under a key like `token`, `password`, `passcode`, `authorization`,
  `password_hash` or `service_tokens` is replaced whole;
- by shape: `scheme://user:password@host` URLs, `Authorization: Token …` / `Bearer …`
  values and `password=…`-style pairs inside free text (messages, tracebacks);
- by value: secrets known from the settings (service tokens, passwords in URLs) are
  replaced wherever they appear.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

MASK = "***"

_SECRET_KEY = re.compile(r"token|password|passcode|passwd|secret|authorization|cookie", re.I)
# Keys that name a secret but whose values are not one (booleans and counts pass anyway).
_NOT_SECRET_KEYS = frozenset({"token_changed", "has_token", "token_expires_at"})

_URL_USERINFO = re.compile(
    r"(?P<prefix>\b[a-z][a-z0-9+.-]*://[^:/@\s]*):(?P<secret>[^@/\s]+)@", re.I
)
_AUTH_HEADER = re.compile(
    r"(?P<prefix>\bauthorization\b[\"']?\s*[:=,]\s*[\"']?(?:token|bearer|basic)?\s*)"
    # `<service token>`: a placeholder in the docs and in error messages, not a secret.
    r"(?P<secret>(?!<)(?!(?:token|bearer|basic)\s+<)[^\s\"',;)}\]]+)",
    re.I,
)
_AUTH_SCHEME = re.compile(
    r"(?P<prefix>\b(?:Token|Bearer|Basic)\s+)(?P<secret>[\w.~+/=-]{16,})", re.I
)
_KEY_VALUE = re.compile(
    r"(?P<prefix>\b[\w-]*(?:password|passcode|passwd|token|secret)[\w-]*[\"']?\s*[:=]\s*[\"']?)"
    r"(?P<secret>[^\s\"',;&)}\]]+)",
    re.I,
)
# RabbitMQ's rabbit_password_hashing_sha256 format: base64 of a 4-byte salt and a
# 32-byte digest, 48 characters, mixed case (which sets it apart from hex digests).
_RABBIT_HASH = re.compile(
    r"(?<![A-Za-z0-9+/=])(?=[^\s]*[a-z])(?=[^\s]*[A-Z])[A-Za-z0-9+/]{48}(?![A-Za-z0-9+/=])"
)
# Words without which none of _AUTH_HEADER, _AUTH_SCHEME, _KEY_VALUE can match.
_TRIGGERS = (
    "token",
    "bearer",
    "basic",
    "authorization",
    "password",
    "passcode",
    "passwd",
    "secret",
)
# Too short to mask by value without masking ordinary words (e.g. the default "guest").
_MIN_KNOWN_SECRET = 8


@functools.lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    # Cached: log lines repeat the same few dozen keys, and every value is asked about.
    return key.lower() not in _NOT_SECRET_KEYS and bool(_SECRET_KEY.search(key))


def _mask_group(match: re.Match[str]) -> str:
    secret = match.group("secret")
    if secret == MASK or secret.lower() in ("null", "none", "true", "false"):
        return match.group(0)
    return match.group("prefix") + MASK


class Redactor:
    """Masks secrets in text and in nested structures."""

    def __init__(self, known_secrets: Iterable[str] = ()) -> None:
        self._known: list[str] = []
        self.add_known(known_secrets)

    def add_known(self, secrets: Iterable[str]) -> None:
        for secret in secrets:
            if secret and len(secret) >= _MIN_KNOWN_SECRET and secret not in self._known:
                self._known.append(secret)
        # Longest first, so a secret that contains another is masked whole.
        self._known.sort(key=len, reverse=True)

    def text(self, value: str) -> str:
        # Every log value passes through here: cheap substring tests decide which of the
        # regexes can match at all, so an ordinary value costs a few `in` checks.
        for secret in self._known:
            if secret in value:
                value = value.replace(secret, MASK)
        if "://" in value:
            value = _URL_USERINFO.sub(_mask_group, value)
        lowered = value.lower()
        if any(word in lowered for word in _TRIGGERS):
            for pattern in (_AUTH_HEADER, _AUTH_SCHEME, _KEY_VALUE):
                value = pattern.sub(_mask_group, value)
        if len(value) >= 48:
            value = _RABBIT_HASH.sub(MASK, value)
        return value

    def value(self, value: Any, key: str | None = None) -> Any:
        if key is not None and is_secret_key(key):
            if isinstance(value, str | bytes) and value:
                return MASK
            if isinstance(value, list | tuple | set | dict) and value:
                return MASK
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v, str(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value


def redact_url(url: str) -> str:
    """`amqp://user:secret@host/` → `amqp://user:***@host/`; other URLs unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _URL_USERINFO.sub(_mask_group, url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return parts._replace(netloc=f"{user}:{MASK}@{netloc[2]}").geturl()


def url_password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


default_redactor = Redactor()
