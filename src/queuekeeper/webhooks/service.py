"""Webhook consumers (contract §13, §14; docs/decisions/027-webhook-registration.md):
registration, update, secret rotation and the status's pending copies.

A webhook consumer is an event consumer (consumers/) that receives by HTTP: the same row,
bindings, filters, quota and owner lock, its bindings checked by the same rules
(`consumers.check_bindings`), and no broker object. What is only the webhook's is here: its owner (a
staff or support user), its URL (checked by the address rule, webhooks/urls.py) and its
signing secret. Reading, deleting and resyncing a consumer are the same for both kinds
(consumers/service.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.common.quotas import check_quota
from queuekeeper.common.urls import destination
from queuekeeper.config import Settings
from queuekeeper.consumers import repository
from queuekeeper.consumers import service as consumers
from queuekeeper.consumers.schemas import ScopeIn, bindings_of, token_prefix
from queuekeeper.events import outbox
from queuekeeper.exceptions import BadRequest, Forbidden, NotFound
from queuekeeper.models import EventConsumer, EventConsumerBinding, EventConsumerScope, User, utcnow
from queuekeeper.observability.metrics import CONSUMER_REGISTRATIONS
from queuekeeper.owners.service import owner_locked
from queuekeeper.webhooks import urls
from queuekeeper.webhooks.schemas import RotateSecret, WebhookRegistration, WebhookUpdate

log = structlog.get_logger(__name__)


async def webhook_pending(session: AsyncSession, consumer_uuid: uuid.UUID) -> repository.Pending:
    """A webhook consumer's copies waiting for its receiver: how many, the oldest, the next
    attempt (contract §13's status)."""
    return await repository.webhook_pending(session, consumer_uuid)


async def _webhook_owner(
    session: AsyncSession, caller: User | None, named: uuid.UUID | None
) -> User:
    """Who owns a new webhook consumer: the calling user, or for a service token the staff or
    support user it names (every event delivered is checked against the owner's access)."""
    if caller is not None:
        if named is not None and named != caller.uuid:
            raise BadRequest(
                "`user_uuid` names another owner, which only the service token may do: omit "
                "it to register for yourself.",
                field="user_uuid",
            )
        return caller
    if named is None:
        raise BadRequest(
            "A service token registers a webhook consumer for a user: name its owner (a staff "
            "or support user) in `user_uuid`.",
            field="user_uuid",
        )
    owner = await session.get(User, named)
    if owner is None:
        raise BadRequest(
            f"Unknown user {named.hex}: the backend has not pushed it.", field="user_uuid"
        )
    if not (owner.is_staff or owner.is_support):
        raise Forbidden(
            f"User {owner.username!r} is neither a staff nor a support user: a webhook "
            "consumer is owned by one.",
            field="user_uuid",
        )
    return owner


def _wanted_webhook(
    owner: User,
    token: str | None,
    scopes: Sequence[tuple[str, uuid.UUID]],
    object_types: list[str] | None,
    payload_filters: dict[str, list[Any]] | None,
) -> consumers.Wanted:
    return consumers.Wanted(
        owner=owner,
        offerings=[entity for kind, entity in scopes if kind == "offering"],
        object_types=object_types,
        identity_uuid=None,
        owner_uuid=owner.uuid,
        # Never a piece of the service token.
        token_prefix=token_prefix(token) if token is not None else "",
        bindings=tuple((kind, entity) for kind, entity in scopes if kind != "offering"),
        is_global=not scopes,
        payload_filters=payload_filters,
    )


def _rebind(consumer: EventConsumer, wanted: consumers.Wanted) -> None:
    """Bring the consumer's bindings to `wanted`'s, keeping the rows of those it holds still
    (a binding deleted and inserted again in one flush would meet its own unique key)."""
    offerings = set(wanted.offerings)
    kept_scopes = [s for s in consumer.scopes if s.offering_uuid in offerings]
    held = {s.offering_uuid for s in kept_scopes}
    consumer.scopes = kept_scopes + [
        EventConsumerScope(offering_uuid=o) for o in wanted.offerings if o not in held
    ]
    others = set(wanted.bindings)
    kept = [b for b in consumer.bindings if (b.scope_type, b.scope_uuid) in others]
    present = {(b.scope_type, b.scope_uuid) for b in kept}
    consumer.bindings = kept + [
        EventConsumerBinding(scope_type=kind, scope_uuid=entity)
        for kind, entity in wanted.bindings
        if (kind, entity) not in present
    ]
    consumer.is_global = wanted.is_global


def _pairs(scopes: Sequence[ScopeIn]) -> list[tuple[str, uuid.UUID]]:
    return [(scope.type, scope.uuid) for scope in scopes]


async def register_webhook(
    session: AsyncSession,
    settings: Settings,
    caller: User | None,
    token: str | None,
    body: WebhookRegistration,
) -> EventConsumer:
    """`POST /api/event-consumers/register_webhook/`: a new consumer that receives by HTTP.

    The bindings are checked as /api/event-consumers/register/ checks them
    (`consumers.check_bindings`), the URL by the address rule; no broker object is made.
    Not idempotent: every call makes a consumer with a secret of its own
    (docs/decisions/027-webhook-registration.md)."""
    consumers.staff_only(caller, "register a webhook consumer")
    owner = await _webhook_owner(session, caller, body.user_uuid)
    wanted = _wanted_webhook(
        owner, token, _pairs(body.scopes), body.object_types, body.payload_filters
    )
    await consumers.check_bindings(session, wanted)
    await session.commit()
    url = await urls.checked(body.webhook_url, settings.webhook_allowed_networks)
    owner_uuid = wanted.owner_uuid
    consumer_uuid = uuid.uuid4()
    # The owner lock, as every registration: parallel calls cannot pass the quota together
    # (docs/decisions/002-owner-lock.md).
    async with owner_locked(session, owner_uuid, vhost_exclusive=False):
        held = await repository.count_of_owner(session, owner_uuid)
        check_quota(settings, "max_consumers_per_user", held, "event consumers")
        await consumers.check_bindings(session, wanted, lock=True)
        session.add(
            consumers.new_consumer(
                consumer_uuid,
                owner_uuid,
                wanted,
                agent_identity_uuid=None,
                # No key: a repeat makes another consumer (decision 027).
                scope_key=None,
                queue_name=topology.webhook_queue_name(consumer_uuid),
                vhost=topology.vhost_name(owner_uuid),
                broker_password_hash=None,
                delivery=consumers.WEBHOOK,
                webhook_url=url,
                webhook_secret=urls.new_secret(),
            )
        )
        await session.commit()
    CONSUMER_REGISTRATIONS.labels(route="register_webhook", outcome="created").inc()
    consumer = await repository.fresh(session, consumer_uuid)
    await session.commit()
    if consumer is None:
        raise NotFound("The consumer was deleted while it was being registered.")
    # The destination only: the URL may hold a credential.
    log.info(
        "webhook_consumer_created",
        consumer=consumer_uuid.hex,
        destination=destination(url),
        owner=owner_uuid.hex,
        is_global=consumer.is_global,
        object_types=consumer.object_types or "all",
    )
    return consumer


async def update_webhook(
    session: AsyncSession,
    settings: Settings,
    caller: User | None,
    consumer_uuid: str,
    body: WebhookUpdate,
) -> EventConsumer:
    """`POST /api/event-consumers/{uuid}/update_webhook/`: what the body names changes; the
    bindings are checked again (all of them, as the owner holds them now), and a consumer
    stopped by a 410 resumes. Copies not yet delivered that the new bindings no longer
    allow are given up, as a revocation gives them up
    (docs/decisions/021-authorized-when-published.md)."""
    consumers.staff_only(caller, "update a webhook consumer")
    found = await consumers.get_consumer(session, caller, consumer_uuid)
    if found.delivery != consumers.WEBHOOK:
        raise BadRequest(
            f"Event consumer {found.uuid.hex} is a queue (`rmq`) consumer: register it again "
            "with /api/event-consumers/register/ to change it, or delete it and register a "
            "webhook consumer.",
            field="delivery",
        )
    key, owner_uuid = found.uuid, found.user_uuid
    owner = found.owner
    scopes = body.scopes
    wanted = _wanted_webhook(
        owner,
        None,
        _pairs(scopes) if scopes is not None else bindings_of(found),
        body.object_types,
        body.payload_filters,
    )
    if scopes is None:
        wanted = replace(wanted, is_global=found.is_global)
    await consumers.check_bindings(session, wanted)
    await session.commit()
    url = (
        await urls.checked(body.webhook_url, settings.webhook_allowed_networks)
        if body.webhook_url is not None
        else None
    )
    async with owner_locked(session, owner_uuid, vhost_exclusive=False):
        consumer = await repository.get(session, key)
        if consumer is None:
            raise NotFound(f"Event consumer {consumer_uuid!r} not found.")
        await consumers.check_bindings(session, wanted, lock=True)
        now = utcnow()
        if wanted.object_types is not None:
            consumer.object_types = list(wanted.object_types)
        if wanted.payload_filters is not None:
            consumer.payload_filters = dict(wanted.payload_filters)
        if scopes is not None:
            _rebind(consumer, wanted)
        if url is not None:
            consumer.webhook_url = url
        # An update is the operator's answer to a 410 or a run of failures: delivery
        # resumes, the copies waiting fall due now, and the next attempt says whether it
        # still fails (`last_error` keeps what happened).
        consumer.webhook_gone_at = None
        consumer.webhook_failing_since = None
        consumer.modified = now
        await session.flush()
        given_up = await outbox.give_up_waiting(
            session,
            now,
            "the consumer's bindings no longer allow it",
            "not_authorized",
            consumer_uuids=[key],
            unauthorized_only=True,
        )
        await outbox.webhook_copies_due_now(session, key, now)
        await session.commit()
    consumer = await repository.fresh(session, key)
    await session.commit()
    if consumer is None:
        raise NotFound(f"Event consumer {consumer_uuid!r} not found.")
    log.info(
        "webhook_consumer_updated",
        consumer=key.hex,
        destination=destination(consumer.webhook_url or ""),
        url_changed=url is not None,
        given_up=given_up,
    )
    return consumer


async def rotate_secret(
    session: AsyncSession, caller: User | None, consumer_uuid: str, body: RotateSecret
) -> tuple[str, datetime | None]:
    """`POST /api/event-consumers/{uuid}/rotate_secret/` (who may update_webhook): a new
    signing secret; the previous one signs every delivery beside it for
    `previous_valid_seconds` (contract §14). Returns the new secret and the window's end."""
    consumers.staff_only(caller, "rotate a webhook consumer's secret")
    found = await consumers.get_consumer(session, caller, consumer_uuid)
    if found.delivery != consumers.WEBHOOK:
        raise BadRequest(
            f"Event consumer {found.uuid.hex} is a queue (`rmq`) consumer: it has no signing "
            "secret (its agent logs in with its API token).",
            field="delivery",
        )
    key, owner_uuid = found.uuid, found.user_uuid
    await session.commit()
    async with owner_locked(session, owner_uuid, vhost_exclusive=False):
        consumer = await repository.get(session, key)
        if consumer is None:
            raise NotFound(f"Event consumer {consumer_uuid!r} not found.")
        now = utcnow()
        until = (
            now + timedelta(seconds=body.previous_valid_seconds)
            if body.previous_valid_seconds
            else None
        )
        secret = urls.new_secret()
        consumer.webhook_previous_secret = consumer.webhook_secret if until else None
        consumer.webhook_previous_until = until
        consumer.webhook_secret = secret
        consumer.modified = now
        await session.commit()
    log.info(
        "webhook_secret_rotated",
        consumer=key.hex,
        previous_valid_until=until.isoformat() if until else None,
    )
    return secret, until
