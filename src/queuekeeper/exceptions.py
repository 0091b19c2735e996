"""What services raise: failures in the domain's own words, free of HTTP.

Services and repositories raise these (or the broker layer's own typed errors);
`errors.py` is the one place that maps each class to a status code and adds the
headers that belong with it (`Retry-After` on `Unavailable`, the challenge on
`Unauthorized`). Nothing below the endpoints knows a status code.
"""

from __future__ import annotations

from typing import Any

# What an error quotes of the caller's input: enough to recognise it, never the whole of
# it (a 60,000-character path segment was once echoed back in a 60 KB answer).
SHOWN_CHARS = 64
# Every detail, whatever it quotes: the net under a message that quotes input unshortened.
DETAIL_MAX_CHARS = 1_000


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as an error quotes it (its repr), cut to `limit` characters with an ellipsis
    and its length when longer."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def capped(detail: str, limit: int = DETAIL_MAX_CHARS) -> str:
    if len(detail) <= limit:
        return detail
    return f"{detail[:limit]}… (truncated; {len(detail)} characters)"


class DomainError(Exception):
    """A failure a caller can act on: `detail` says what, `field` names the input at fault."""

    def __init__(
        self,
        detail: str,
        *,
        field: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        detail = capped(self.detail)
        body: dict[str, Any] = {"detail": detail}
        if self.field:
            body["errors"] = [{"field": self.field, "message": detail}]
        body.update(self.extra)
        return body


class BadRequest(DomainError):
    """The input is wrong; `field` names it."""


class Unauthorized(DomainError):
    """No valid credentials. `scheme` is the one the caller should use (`Token`, `Bearer`)."""

    def __init__(self, detail: str, *, scheme: str = "Token", **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        self.scheme = scheme


class Forbidden(DomainError):
    """Known caller, not allowed."""


class NotFound(DomainError):
    """No such thing, or not the caller's (the two are not told apart)."""


class Conflict(DomainError):
    """The request contradicts what exists (another owner, a run already in progress)."""


class Unavailable(DomainError):
    """A dependency (database, RabbitMQ) is down: retry later; what was said was kept or
    nothing changed, as `detail` tells."""


class QuotaExceeded(Conflict):
    """A per-user limit is reached; `limit` and `setting` name it so an operator can raise it."""

    def __init__(self, what: str, limit: int, setting: str) -> None:
        super().__init__(
            f"Limit reached: at most {limit} {what} per user (setting "
            f"QUEUEKEEPER_{setting.upper()}). Delete some, or ask the operator to raise it.",
            extra={"limit": limit, "setting": setting},
        )
        self.limit = limit
        self.setting = setting


class TooLarge(DomainError):
    """A request body (or one event's payload) over its limit; `setting` names the limit."""

    def __init__(self, detail: str, *, limit: int, setting: str, field: str | None = None) -> None:
        super().__init__(detail, field=field, extra={"limit": limit, "setting": setting})


class RateLimited(DomainError):
    """Too many calls of one kind for one caller; retry after `retry_after` seconds."""

    def __init__(self, detail: str, *, retry_after: int, limit: str, setting: str) -> None:
        super().__init__(detail, extra={"limit": limit, "setting": setting})
        self.retry_after = retry_after
