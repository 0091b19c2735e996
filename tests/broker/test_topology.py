"""Names, arguments and password hashes, as RabbitMQ and the site agent expect them."""

from __future__ import annotations

import uuid

from queuekeeper.broker import topology
from queuekeeper.broker.passwords import rabbit_password_hash, rabbit_password_matches
from queuekeeper.config import Settings


def test_queue_name_is_what_the_agent_computes() -> None:
    subscription = uuid.UUID("0b9a3c1e-5d5e-4f4e-8a3b-1c2d3e4f5a6b")
    offering = uuid.UUID("5F0C4BB3-A05F-4C3A-9F5E-5B3A1F2D3C4B")
    name = topology.queue_name(subscription, offering, "order")
    # waldur-site-agent: f"subscription_{sub.hex}_offering_{offering_uuid.replace('-', '')}_{type}"
    assert (
        name == f"subscription_{subscription.hex}_offering_{str(offering).replace('-', '')}_order"
    )
    match = topology.QUEUE_NAME_RE.match(name)
    assert match is not None
    assert match["object_type"] == "order"


def test_arguments_follow_settings() -> None:
    settings = Settings(queue_max_length=5, dlq_name="dlq")
    arguments = topology.queue_arguments(settings)
    assert arguments["x-max-length"] == 5
    assert arguments["x-dead-letter-routing-key"] == "dlq"
    assert topology.argument_differences(arguments, dict(arguments)) == []
    assert topology.argument_differences(arguments, {}) != []


def test_rabbit_sha256_hash_matches_rabbitmq_documentation() -> None:
    # The worked example from RabbitMQ's "Credentials and Passwords" guide.
    salt = bytes.fromhex("908DC60A")
    assert (
        rabbit_password_hash("test12", salt) == "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
    )
    hashed = rabbit_password_hash("s3cret")
    assert rabbit_password_matches("s3cret", hashed)
    assert not rabbit_password_matches("other", hashed)
    assert hashed != rabbit_password_hash("s3cret")  # salted
