"""Where every broker name and every queue argument comes from. Nothing else builds them."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from queuekeeper.config import Settings

SUBSCRIPTION_QUEUE_PREFIX = "subscription_"
QUEUE_NAME_RE = re.compile(
    r"^subscription_(?P<subscription>[0-9a-f]{32})_offering_(?P<offering>[0-9a-f]{32})_(?P<object_type>[a-z_]+)$"
)
# contract §9: one queue per consumer, named by the server (the agent takes it verbatim).
CONSUMER_QUEUE_PREFIX = "consumer_"
CONSUMER_QUEUE_RE = re.compile(r"^consumer_(?P<consumer>[0-9a-f]{32})$")
# Every queue name queuekeeper makes starts with one of these; reconcile and the admin view
# judge only those (the dead-letter queue and anything else are not registrations).
REGISTERED_QUEUE_PREFIXES = (SUBSCRIPTION_QUEUE_PREFIX, CONSUMER_QUEUE_PREFIX)
_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")
# Permissions are regexes matched against the whole name, so anchor both ends.
NOTHING = "^$"
EVERYTHING = ".*"


# Every vhost and broker user queuekeeper makes carries two tags: `queuekeeper:<instance
# name>` for people, and this one with the installation's uuid, which decides ownership
# (docs/decisions/001-installation-identity.md).
INSTALLATION_TAG_PREFIX = "queuekeeper-installation:"


def installation_tag(installation: uuid.UUID) -> str:
    return f"{INSTALLATION_TAG_PREFIX}{installation.hex}"


def installations_of(tags: tuple[str, ...] | list[str]) -> list[str]:
    """The installation uuids (hex) an object's tags name; empty for an object made before
    installations had identities."""
    return [
        tag.removeprefix(INSTALLATION_TAG_PREFIX)
        for tag in tags
        if tag.startswith(INSTALLATION_TAG_PREFIX)
    ]


def vhost_name(owner_uuid: uuid.UUID) -> str:
    """One vhost per user: the agent connects with `host = <user uuid hex>`."""
    return owner_uuid.hex


VHOST_NAME_RE = re.compile(r"^[0-9a-f]{32}$")


def is_vhost_name(name: str) -> bool:
    """Could this be one of our vhosts? Anything else is refused before any broker call."""
    return VHOST_NAME_RE.fullmatch(name) is not None


def subscription_user_name(subscription_uuid: uuid.UUID) -> str:
    """The agent logs in to STOMP with `login = <subscription uuid hex>`."""
    return subscription_uuid.hex


def uuid_of(name: str) -> uuid.UUID | None:
    """The user of a vhost, or the subscription of a broker user; None when it names none."""
    try:
        return uuid.UUID(hex=name)
    except ValueError:
        return None


def named_like_subscription_user(name: str) -> bool:
    """Exactly our form, a subscription's or a consumer's (a user that lost its tag is still
    recognised as ours by its name)."""
    return _UUID_HEX.match(name) is not None


def queue_name(subscription_uuid: uuid.UUID, offering_uuid: uuid.UUID, object_type: str) -> str:
    """The agent computes this name itself, so it must be exactly this form (lowercase hex)."""
    return (
        f"{SUBSCRIPTION_QUEUE_PREFIX}{subscription_uuid.hex}"
        f"_offering_{offering_uuid.hex}_{object_type}"
    )


def subscription_queue_pattern(subscription_uuid: uuid.UUID) -> str:
    return f"^{SUBSCRIPTION_QUEUE_PREFIX}{subscription_uuid.hex}_.*$"


def consumer_queue_name(consumer_uuid: uuid.UUID) -> str:
    """`consumer_<uuid hex>`, as Waldur Mastermind names it (its tooling parses that form)."""
    return f"{CONSUMER_QUEUE_PREFIX}{consumer_uuid.hex}"


# A webhook consumer's `queue_name`: a name no broker queue has (none is declared for it),
# which marks its copies as webhook copies (events/recipients.py `webhook_copy_sql`).
WEBHOOK_QUEUE_PREFIX = "webhook_"


def webhook_queue_name(consumer_uuid: uuid.UUID) -> str:
    """`webhook_<uuid hex>`: a webhook consumer's name in the rows a queue's name fills
    (its copies, its presence); no broker queue has it, none is declared (contract §13)."""
    return f"{WEBHOOK_QUEUE_PREFIX}{consumer_uuid.hex}"


def consumer_user_name(consumer_uuid: uuid.UUID) -> str:
    """The 1.0.7 agent logs in with `login = rmq_username`, which is this."""
    return consumer_uuid.hex


def consumer_of(queue_name: str) -> uuid.UUID | None:
    """The consumer a `consumer_<hex>` queue belongs to; None for any other name."""
    match = CONSUMER_QUEUE_RE.match(queue_name)
    return uuid.UUID(hex=match["consumer"]) if match else None


def is_registered_kind(queue_name: str) -> bool:
    """Named like a queue queuekeeper registers (a subscription's or a consumer's)."""
    return queue_name.startswith(REGISTERED_QUEUE_PREFIXES)


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str

    def as_body(self) -> dict[str, str]:
        return {"configure": self.configure, "write": self.write, "read": self.read}


def subscription_permissions(subscription_uuid: uuid.UUID) -> Permissions:
    """Read its own queues, nothing else.

    With no configure permission a STOMP SUBSCRIBE to a queue that does not exist
    cannot create it, so the auto-created-without-arguments race cannot happen.
    """
    return Permissions(
        configure=NOTHING, write=NOTHING, read=subscription_queue_pattern(subscription_uuid)
    )


def consumer_permissions(consumer_uuid: uuid.UUID) -> Permissions:
    """Read its one queue, nothing else (Waldur grants `.*` on all three; contract §9 does not)."""
    return Permissions(
        configure=NOTHING,
        write=NOTHING,
        read=f"^{re.escape(consumer_queue_name(consumer_uuid))}$",
    )


SERVICE_PERMISSIONS = Permissions(configure=EVERYTHING, write=EVERYTHING, read=EVERYTHING)


QUEUE_TYPE = "x-queue-type"
# The one `x-overflow` under which a full queue dead-letters the publishes it nacks.
DEAD_LETTERING_OVERFLOW = "reject-publish-dlx"
CLASSIC = "classic"
QUORUM = "quorum"


def queue_arguments(settings: Settings) -> dict[str, Any]:
    """Every registered queue's arguments (both kinds: subscription and consumer queues)."""
    arguments: dict[str, Any] = {
        "x-message-ttl": settings.queue_message_ttl_ms,
        "x-max-length": settings.queue_max_length,
        "x-overflow": settings.queue_overflow,
        "x-dead-letter-exchange": settings.dead_letter_exchange,
        "x-dead-letter-routing-key": settings.dlq_name,
    }
    if settings.queue_type == QUORUM:
        # RabbitMQ 3.10 accepts `reject-publish-dlx` on a quorum queue (201) and silently
        # behaves as `drop-head`, dead-lettering the *oldest* event. So a full quorum queue
        # nacks the publisher instead (the relay retries), and TTL expiry is dead-lettered
        # at-least-once, which RabbitMQ allows only together with `reject-publish`.
        arguments.update(
            {
                QUEUE_TYPE: QUORUM,
                "x-overflow": "reject-publish",
                "x-dead-letter-strategy": "at-least-once",
            }
        )
    return arguments


def dead_letter_queue_arguments(settings: Settings) -> dict[str, Any]:
    """The dead-letter queue is of the same type as the queues whose dead letters it keeps:
    on a quorum installation it must survive a node loss too."""
    arguments: dict[str, Any] = {
        "x-max-length": settings.dlq_max_length,
        "x-message-ttl": settings.dlq_message_ttl_ms,
        "x-overflow": settings.dlq_overflow,
    }
    if settings.queue_type == QUORUM:
        arguments[QUEUE_TYPE] = QUORUM
    return arguments


def queue_type(arguments: dict[str, Any]) -> str:
    """A queue declared without `x-queue-type` is classic."""
    return str(arguments.get(QUEUE_TYPE) or CLASSIC)


def argument_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences; empty when the broker holds exactly what we asked for.

    The type comes first and in words: it is the one difference that cannot be changed in
    place (the queue must be re-created, so only when it is empty and unconsumed).
    """
    differences = []
    want_type, have_type = queue_type(expected), queue_type(actual)
    if want_type != have_type:
        differences.append(
            f"queue type: expected {want_type}, broker has {have_type} "
            "(cannot change in place: re-created only when empty and unconsumed)"
        )
    for key in sorted((set(expected) | set(actual)) - {QUEUE_TYPE}):
        want, have = expected.get(key, "<absent>"), actual.get(key, "<absent>")
        if want != have:
            differences.append(f"{key}: expected {want!r}, broker has {have!r}")
    return differences


def vhost_limits(settings: Settings) -> dict[str, int]:
    """RabbitMQ's own limits on every user vhost (PUT /api/vhost-limits/{vhost}/{name})."""
    return {
        "max-connections": settings.broker_vhost_max_connections,
        "max-queues": settings.broker_vhost_max_queues,
    }


def user_limits(settings: Settings) -> dict[str, int]:
    """RabbitMQ's own limits on every agent broker user (PUT /api/user-limits/, 3.8.10+)."""
    return {
        "max-connections": settings.broker_user_max_connections,
        "max-channels": settings.broker_user_max_channels,
    }


def limit_differences(expected: dict[str, int], actual: dict[str, int]) -> list[str]:
    return [
        f"{name}: expected {value}, broker has {actual.get(name, '<none>')}"
        for name, value in sorted(expected.items())
        if actual.get(name) != value
    ]
