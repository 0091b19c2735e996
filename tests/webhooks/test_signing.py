"""The signature and the retry schedule as pure functions (contract §13)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from queuekeeper.webhooks.schedule import retry_at, retry_delay
from queuekeeper.webhooks.signing import headers

SCHEDULE = [1.0, 5.0, 25.0, 60.0, 300.0, 900.0, 3600.0]


def test_the_signature_verifies_with_the_standard_s_library() -> None:
    secret = "whsec_" + base64.b64encode(b"k" * 24).decode()
    body = b'{"object_type":"order","n":1}'
    sent = headers(secret, "event-1", 1_700_000_000, body)
    verifier = Webhook(secret)
    # The library checks the timestamp's age too: verify one made now.
    import time

    now = int(time.time())
    fresh = headers(secret, "event-1", now, body)
    assert verifier.verify(body, fresh) == {"object_type": "order", "n": 1}
    assert sent["webhook-signature"].startswith("v1,")
    with pytest.raises(WebhookVerificationError):
        verifier.verify(body + b" ", fresh)
    other = "whsec_" + base64.b64encode(b"o" * 24).decode()
    with pytest.raises(WebhookVerificationError):
        Webhook(other).verify(body, fresh)


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(1, 1.0), (2, 5.0), (3, 25.0), (4, 60.0), (5, 300.0), (6, 900.0), (7, 3600.0), (30, 3600.0)],
)
def test_the_schedule_s_delay_for_each_failed_attempt_then_the_last_repeated(
    attempt: int, delay: float
) -> None:
    assert retry_delay(attempt, SCHEDULE, 0.0) == delay


def test_jitter_adds_up_to_a_fifth_never_less() -> None:
    assert retry_delay(2, SCHEDULE, 0.0) == 5.0
    assert retry_delay(2, SCHEDULE, 0.5) == pytest.approx(5.5)
    assert retry_delay(2, SCHEDULE, 0.999999) == pytest.approx(6.0, abs=1e-4)
    assert all(5.0 <= retry_delay(2, SCHEDULE, d / 100) < 6.0 for d in range(100))


def test_a_retry_is_never_scheduled_past_the_copy_s_give_up_time() -> None:
    """An old copy is given up on time, not up to a whole delay after retention ended."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    retention = timedelta(days=1)
    fresh = now - timedelta(hours=1)
    assert retry_at(7, fresh, now, SCHEDULE, retention, 0.0) == now + timedelta(seconds=3600)
    nearly_gone = now - retention + timedelta(seconds=30)
    assert retry_at(7, nearly_gone, now, SCHEDULE, retention, 0.0) == nearly_gone + retention
    gone = now - retention - timedelta(seconds=30)
    assert retry_at(7, gone, now, SCHEDULE, retention, 0.5) == now
