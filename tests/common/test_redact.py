"""Secret masking, pattern by pattern: what must go, and what must stay readable."""

from __future__ import annotations

import pytest

from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.common.redact import MASK, Redactor, redact_url

TOKEN = "2f6c1e0b9d0a4c53a5e4c1f2b3a4d5e6f7a8b9c0"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("connecting to amqp://queuekeeper:s3cr3t-pw@rabbit:5672/", "s3cr3t-pw"),
        ("postgresql+asyncpg://qk:pg%40pass@db/qk refused", "pg%40pass"),
        (f"Authorization: Token {TOKEN}", TOKEN),
        ("headers={'authorization': 'abc123xyz'}", "abc123xyz"),
        ("authorization=abc123xyz", "abc123xyz"),
        (f"sent Bearer {TOKEN}", TOKEN),
        ('{"token": "short-tok"}', "short-tok"),
        ("password=hunter22&user=x", "hunter22"),
        ("passcode: letmein99", "letmein99"),
        ('"password_hash": "whatever-hash"', "whatever-hash"),
        pytest.param(
            f"params ('{(hashed := rabbit_password_hash('x'))}', None)",
            hashed[:40],
            id="rabbitmq-password-hash",  # salted: the same id in every collection
        ),
    ],
)
def test_secret_shapes_are_masked(text: str, secret: str) -> None:
    masked = Redactor().text(text)
    assert secret not in masked
    assert MASK in masked


@pytest.mark.parametrize(
    "text",
    [
        "Token has expired.",
        "queue subscription_0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a"
        "_offering_5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b_order",
        "vhost 8b1a9953c4611296a827abf8c47804d7",
        "token_hash 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "http://127.0.0.1:15672/api/queues/x",
        "Malformed Authorization header: expected `Token <token>` or `Bearer <token>`.",
        "Authentication credentials were not provided: send "
        "`Authorization: Bearer <service token>`.",
        "Invalid service token. Send `Authorization: Bearer <service token>` with one of "
        "QUEUEKEEPER_SERVICE_TOKENS.",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert Redactor().text(text) == text


def test_known_secrets_are_masked_wherever_they_appear() -> None:
    redactor = Redactor(["service-token-primary-0123", "guest"])
    assert redactor.text("x service-token-primary-0123 y") == f"x {MASK} y"
    # Too short to mask by value without masking ordinary words.
    assert redactor.text("user guest logged in") == "user guest logged in"


def test_values_under_secret_keys_are_masked_whole() -> None:
    redactor = Redactor()
    masked = redactor.value(
        {
            "token": TOKEN,
            "service_tokens": ["a-token", "b-token"],
            "headers": {"Authorization": f"Token {TOKEN}", "Accept": "*/*"},
            "token_changed": True,
            "has_token": True,
            "queue": "q1",
        }
    )
    assert masked == {
        "token": MASK,
        "service_tokens": MASK,
        "headers": {"Authorization": MASK, "Accept": "*/*"},
        "token_changed": True,
        "has_token": True,
        "queue": "q1",
    }


def test_redact_url_keeps_everything_but_the_password() -> None:
    assert redact_url("amqps://qk:pw@rabbit:5671/vh?x=1") == "amqps://qk:***@rabbit:5671/vh?x=1"
    assert redact_url("http://127.0.0.1:15672") == "http://127.0.0.1:15672"
