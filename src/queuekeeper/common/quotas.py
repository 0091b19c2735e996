"""Per-user quotas and free-text bounds, checked by the services before anything is made.

Each refusal names the limit and its setting, so the agent's operator knows what to ask for.
Each is counted again under the owner lock in the transaction that inserts (for queues, in
the insert itself; docs/decisions/002-owner-lock.md), so parallel calls never pass it together.
"""

from __future__ import annotations

from queuekeeper.config import Settings
from queuekeeper.exceptions import BadRequest, QuotaExceeded


def check_quota(settings: Settings, setting: str, held: int, what: str) -> None:
    """Refuse one more when `held` already reaches the limit the setting `setting` holds."""
    limit = int(getattr(settings, setting))
    if held >= limit:
        raise QuotaExceeded(what, limit, setting)


def check_text(settings: Settings, **fields: str | None) -> None:
    """Each named free-text value fits `text_max_length`; the first that does not is a 400."""
    limit = settings.text_max_length
    for field, value in fields.items():
        if value is not None and len(value) > limit:
            raise BadRequest(
                f"{field} has {len(value)} characters; at most {limit} are accepted "
                "(setting QUEUEKEEPER_TEXT_MAX_LENGTH).",
                field=field,
                extra={"limit": limit, "setting": "text_max_length"},
            )
